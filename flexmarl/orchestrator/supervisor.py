"""Keeps a pipeline's engines alive: detects lost and hung workers and rebuilds what they held.

Dask's nanny restarts a killed worker process under a new address; the engines it held (rollout engines,
trainers: ``cluster/worker_state.py``) are gone, and tasks pinned to the old address would wait forever.
The supervisor polls the scheduler from the pipeline's loop, and when a worker is lost it:

- gives up the tasks pinned to it: its generation batches go back to the queue (per-request seeds make
  them come out the same elsewhere), its weight syncs are dropped;
- gives its replica slots back: at once one to each agent left without any, on a surviving worker, and
  the rest on a new worker (a nanny's replacement) once the engines they need run there, loaded with the
  weights of the agent's snapshot of its current version (``training/snapshots.py``);
- rebuilds each trainer it held on a live training slot from the agent's snapshot of the version the store
  records, and trains that step's micro-batches again from the start: the lost worker took the partial
  gradient sum with it, so nothing is counted twice, and the result equals the uninterrupted step. A move
  whose target was lost is given up; the trainer it would have moved is still where it was.

A worker is hung when the scheduler has not seen its heartbeat for ``cluster.heartbeat_timeout_s``, or a
generation batch or a weight sync on it passes its deadline (``rollout.request_timeout_s``,
``rollout.sync_timeout_s``). The supervisor has its nanny SIGKILL it; the nanny then starts a new one, as
after any crash, and the hung worker is a lost worker like any other. (Dask's ``restart_workers`` was tried
first: on a frozen worker its kill and the nanny's own restart race, and the new worker can take a minute to
return.) A worker whose nanny does not answer is removed from the scheduler. A worker without a nanny cannot
be replaced: the run then fails, naming agent and replica.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distributed import Future

from flexmarl.cluster.local import ClusterError
from flexmarl.rollout import replica as replica_fns
from flexmarl.rollout.backend import WeightSyncError
from flexmarl.rollout.balancer import Replica
from flexmarl.training import snapshots

if TYPE_CHECKING:
    from flexmarl.orchestrator.pipeline import PipelineRunner

POLL_S = 0.5  # how often the scheduler is asked which workers are alive
KILL_WAIT_S = 10.0  # for a hung worker's nanny to kill it, and for the scheduler to see it gone
TRAINER_KINDS = {"train", "finish", "park", "move", "snapshot", "restore"}  # tasks on the agent's trainer
BLOCKING_KINDS = {"finish", "snapshot", "move", "restore"}  # the agent trains nothing until they are done


@dataclass
class Recovery:
    """Workers that were lost or hung, and when the run had rebuilt what they held."""

    workers: tuple[str, ...]
    cause: str  # "lost", or "hung: <why>"
    detected_at: float  # wall-clock time
    recovered_at: float | None = None  # lost trainers rebuilt, every agent has a replica; None if never


class Supervisor:
    """Detects lost and hung workers for ``runner`` and rebuilds their engines (see the module docstring).

    It acts on the runner's state from the runner's own thread (``poll`` from the loop, ``handle`` for the
    tasks it submits), so nothing here needs a lock.
    """

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.poll_s = POLL_S
        info = self._scheduler_workers()
        self.workers = set(info)
        self.ids = {w: i.get("id") for w, i in info.items()}  # a worker restarted on the same address gets a new id
        now = time.time()
        self.heartbeats = {w: (i.get("last_seen"), now) for w, i in info.items()}
        # Workers that ran something for us. A new worker is not judged by its heartbeat before its first task
        # is done: importing torch in a fresh process can hold the interpreter for many seconds.
        self.proven = set(info)
        self.last_poll = now
        self.restores: dict[str, int] = {}  # agent -> the version its trainer is being rebuilt at
        self.lost_slots: Counter[str] = Counter()  # agent -> replica slots lost and not given back yet
        self.pending_slots: dict[str, list[str]] = {}  # worker -> agents whose slots wait for engines there
        self.recoveries: list[Recovery] = []
        self.open: list[Recovery] = []
        self.waiting_since: float | None = None

    # ------------------------------------------------------------------ detection

    @property
    def waiting(self) -> bool:
        """Work waits for a worker: a trainer to rebuild, or an agent without any replica slot."""
        return bool(self.restores) or any(not reps for reps in self.runner.replicas.values())

    def poll(self, *, force: bool = False) -> bool:
        """Compare the scheduler's workers with the last poll and act on any change; True when it acted.

        Raises:
            ClusterError: work has waited longer than ``cluster.connect_timeout_s`` for a live worker.
        """
        now = time.time()
        if not force and now - self.last_poll < self.poll_s:
            return False
        self.last_poll = now
        info = self._scheduler_workers()
        ids = {w: i.get("id") for w, i in info.items()}
        lost = {w for w in self.workers if ids.get(w) != self.ids.get(w)}
        joined = {w for w in info if w not in self.workers or ids[w] != self.ids.get(w)}
        self.workers, self.ids = set(info), ids
        for worker in lost:
            self.heartbeats.pop(worker, None)
            self.proven.discard(worker)
        acted = False
        if lost & self._ours():
            self._on_lost(lost, "lost")
            acted = True
        silent = self._silent(info, now)
        if silent:
            self._restart(silent, f"no heartbeat for {self.cfg.cluster.heartbeat_timeout_s:.0f}s "
                                  "(cluster.heartbeat_timeout_s)", TimeoutError)
            return True
        if lost or joined or self.waiting or +self.lost_slots:
            acted |= self._rebuild(info)
        self._check_recovered()
        self._check_waiting(now)
        return acted

    def on_late(self, fut: Future, message: str) -> None:
        """A generation batch or weight sync passed its deadline: its replica is hung and gets replaced.

        Raises:
            WeightSyncError, TimeoutError: the worker has no nanny to restart it (``message`` names it).
        """
        error = WeightSyncError if self.runner.inflight[fut][0] == "sync" else TimeoutError
        self._restart({self.runner.worker_of[fut]}, message, error)

    def _restart(self, workers: set[str], why: str, error: type[Exception]) -> None:
        info = self._scheduler_workers()
        alive = sorted(w for w in workers if w in info)
        orphans = [w for w in alive if not info[w].get("nanny")]
        if orphans:
            raise error(f"{why}; worker {orphans[0]} has no nanny to restart it")
        if alive:
            recovery = Recovery(tuple(alive), f"hung: {why}", time.time())
            client = self.runner.client
            # in a thread: a frozen host's nanny may never answer
            killer = threading.Thread(target=client.run, args=(kill_worker_process,),
                                      kwargs={"workers": alive, "nanny": True, "on_error": "ignore"}, daemon=True)
            killer.start()
            killer.join(KILL_WAIT_S)
            deadline = time.time() + KILL_WAIT_S
            while time.time() < deadline and self._same(alive, info):
                time.sleep(0.1)
            for worker in self._same(alive, info):  # its nanny did not kill it: the scheduler forgets it
                client.run_on_scheduler(remove_from_scheduler, worker)
            self.workers -= set(alive)
            for worker in alive:
                self.ids.pop(worker, None)
                self.heartbeats.pop(worker, None)
            self._on_lost(set(alive), recovery.cause, recovery)
        self.poll(force=True)

    def _same(self, workers: list[str], before: dict) -> list[str]:
        """Those of ``workers`` still registered as the same process as in ``before``."""
        now = self._scheduler_workers()
        return [w for w in workers if w in now and now[w].get("id") == before[w].get("id")]

    def _silent(self, info: dict, now: float) -> set[str]:
        """Our workers whose heartbeat the scheduler has not seen for ``cluster.heartbeat_timeout_s``."""
        silent = set()
        ours = self._ours()
        for worker, i in info.items():
            seen = i.get("last_seen")
            last, since = self.heartbeats.get(worker, (None, now))
            if seen != last:
                self.heartbeats[worker] = (seen, now)
            elif worker in ours and worker in self.proven and now - since > self.cfg.cluster.heartbeat_timeout_s:
                silent.add(worker)
        return silent

    def _ours(self) -> set[str]:
        """Workers that hold this run's engines or tasks."""
        r = self.runner
        held = {rep.worker for reps in r.replicas.values() for rep in reps}
        held |= {w for ws in r.engines.values() for w in ws}
        return held | set(r.slots) | set(r.location.values()) | set(r.worker_of.values())

    def _scheduler_workers(self) -> dict[str, dict]:
        return self.runner.client.scheduler_info(n_workers=-1)["workers"]

    # ------------------------------------------------------------------ what a lost worker held

    def _on_lost(self, lost: set[str], cause: str, recovery: Recovery | None = None) -> None:
        r = self.runner
        recovery = recovery or Recovery(tuple(sorted(lost)), cause, time.time())
        self.recoveries.append(recovery)
        self.open.append(recovery)
        lost_trainers = {a for a in self.cfg.agents if r.location[a] in lost}
        for fut, worker in list(r.worker_of.items()):
            if worker not in lost:
                continue
            what = r.forget(fut)
            fut.cancel()
            kind, agent = what[0], what[1]
            if kind == "generate":  # generated again elsewhere: per-request seeds give the same samples
                for ep, node, _ in what[3]:
                    r._enqueue(ep, node)
            elif kind == "sync":
                r.pending_syncs[agent] -= 1
            elif kind in TRAINER_KINDS - {"move", "restore"}:  # these run where the trainer lives
                lost_trainers.add(agent)
        for agent in self.cfg.agents:
            if r.bound.get(agent) in lost:  # a move to it was under way: the trainer is still where it was
                r.bound[agent] = None
            r.engines[agent] = [w for w in r.engines[agent] if w not in lost]
            gone = [rep for rep in r.replicas[agent] if rep.worker in lost]
            self.lost_slots[agent] += len(gone)
            r.replicas[agent][:] = [rep for rep in r.replicas[agent] if rep.worker not in lost]
        for worker in lost:
            r.outstanding_tokens.pop(worker, None)
            for agent in self.pending_slots.pop(worker, []):  # slots that waited for engines there
                self.lost_slots[agent] += 1
        r.engine_version = {k: v for k, v in r.engine_version.items() if k[1] not in lost}
        r.prefetched = {a: p for a, p in r.prefetched.items() if p[0] not in lost}
        r.slots = [w for w in r.slots if w not in lost]
        for agent in sorted(lost_trainers):
            self._lose_trainer(agent)
        for agent in self.cfg.agents:
            self._unblock_if_idle(agent)

    def _lose_trainer(self, agent: str) -> None:
        """Give up everything the agent's trainer was doing; it is rebuilt at the version the store records."""
        r = self.runner
        for fut, what in list(r.inflight.items()):
            # syncs too: they carry weights from the lost trainer's memory, and are redone from its snapshot
            if what[1] == agent and (what[0] in TRAINER_KINDS or what[0] == "sync"):
                r.forget(fut)
                fut.cancel()
        r.pending_syncs[agent] = 0
        version = r.versions[agent]
        for mb in r.micro.get((agent, version), []):  # the step is trained again, on the state of its start
            if mb.sample_ids:
                mb.submitted = mb.trained = False
        r.queued[agent] = 0
        r.bound[agent] = None
        r.blocked[agent] = True
        r.parked.pop(agent, None)  # written by the lost trainer, maybe only in part
        prefetched = r.prefetched.pop(agent, None)
        if prefetched is not None:
            r._discard_prefetch(agent, prefetched[0])
        self.restores[agent] = version

    def _unblock_if_idle(self, agent: str) -> None:
        r = self.runner
        if agent in self.restores or not r.blocked[agent] or r.pending_syncs[agent] > 0:
            return
        if not any(w[1] == agent and w[0] in BLOCKING_KINDS for w in r.inflight.values()):
            r.blocked[agent] = False

    # ------------------------------------------------------------------ rebuilding

    def _rebuild(self, info: dict) -> bool:
        """Add new training workers as slots, rebuild lost trainers and replace lost replica slots (and the
        engines they need). True if it acted."""
        r = self.runner
        acted = False
        limit = self.cfg.training.slots
        for worker in self._offering(info, self.cfg.cluster.train_resource):
            if worker not in r.slots and (limit is None or len(r.slots) < limit):
                r.slots = sorted([*r.slots, worker])
                acted = True
        for agent, version in sorted(self.restores.items()):
            if self._in_flight("restore", agent):
                continue
            target = self._pick_slot()
            if target is None:
                continue
            spec = self.cfg.agents[agent].sampling
            r._submit(target, snapshots.restore_trainer, r.key(agent), r.model_dirs[agent], r.trainer_cfg[agent],
                      spec.temperature, spec.max_new_tokens, self._snapshot(agent, version), version,
                      self.cfg.training.state_storage_options, what=("restore", agent, target, version))
            acted = True
        return self._replace_slots(self._offering(info, self.cfg.cluster.rollout_resource)) or acted

    def _replace_slots(self, rollout: list[str]) -> bool:
        """Give lost replica slots back: first one to each agent left without any, on a live worker (loading
        the agent's engine there if needed), then the rest on new workers, once the engines they need run."""
        r = self.runner
        acted = False
        pending = {a for agents in self.pending_slots.values() for a in agents}
        for agent in self.cfg.agents:
            if r.replicas[agent] or agent in pending:
                continue
            worker = self._pick_survivor(agent, rollout)
            if worker is not None:
                self.lost_slots[agent] = max(self.lost_slots[agent] - 1, 0)
                self._place_slot(agent, worker)
                acted = True
        ours = {w for ws in r.engines.values() for w in ws} | set(self.pending_slots) | {
            w[2] for w in r.inflight.values() if w[0] == "replica"}
        for worker in (w for w in rollout if w not in ours):  # a new worker (a nanny's replacement)
            debt = [a for a in self.cfg.agents for _ in range(self.lost_slots[a])]
            if not debt:
                break
            for agent in debt[: self.cfg.rollout.slots_per_worker]:
                self.lost_slots[agent] -= 1
                self._place_slot(agent, worker)
            acted = True
        return acted

    def _place_slot(self, agent: str, worker: str) -> None:
        """A slot of ``agent`` on ``worker``: at once if the engines it needs are there, else once they are."""
        self.pending_slots.setdefault(worker, []).append(agent)
        for needed in self._engines_needed(agent):
            if worker not in self.runner.engines[needed] and not self._starting(needed, worker):
                self._start_engine(needed, worker)
        self._open_slots(worker)

    def _engines_needed(self, agent: str) -> list[str]:
        # with inter-agent balancing a slot may move to any agent: every agent's engine must be on its worker
        return list(self.cfg.agents) if self.cfg.rollout.load_balance else [agent]

    def _open_slots(self, worker: str) -> None:
        r = self.runner
        waiting = self.pending_slots.get(worker, [])
        for agent in list(waiting):
            if all(worker in r.engines[a] for a in self._engines_needed(agent)):
                waiting.remove(agent)
                r.replicas[agent].append(Replica(agent, worker))
        if not waiting:
            self.pending_slots.pop(worker, None)

    def _start_engine(self, agent: str, worker: str) -> None:
        r = self.runner
        version = r.versions[agent]
        r._submit(worker, replica_fns.restart_replica, r.key(agent), r.model_dirs[agent], version, self.cfg.rollout,
                  snapshots.weights_uri(self._snapshot(agent, version)), self.cfg.training.state_storage_options,
                  what=("replica", agent, worker, version))

    def _starting(self, agent: str, worker: str) -> bool:
        return any(w[0] == "replica" and w[1] == agent and w[2] == worker for w in self.runner.inflight.values())

    def _snapshot(self, agent: str, version: int) -> str | None:
        r = self.runner
        return snapshots.require_snapshot(r.snapshot_root, agent, version, self.cfg.training.state_storage_options)

    def _pick_slot(self) -> str | None:
        """The live training slot hosting the fewest agents (ties: by name)."""
        r = self.runner
        live = [w for w in r.slots if w in self.workers]
        if not live:
            return None
        hosted = Counter(r.location[a] for a in self.cfg.agents if a not in self.restores)
        return min(live, key=lambda w: (hosted[w], w))

    def _pick_survivor(self, agent: str, rollout: list[str]) -> str | None:
        """A live rollout worker for a slot of ``agent``: one holding the engines it needs first, then the one
        holding fewest slots (ties: by name)."""
        r = self.runner
        if not rollout:
            return None
        held = Counter(rep.worker for reps in r.replicas.values() for rep in reps)
        ready = [w for w in rollout if all(w in r.engines[a] for a in self._engines_needed(agent))]
        return min(ready or rollout, key=lambda w: (held[w], w))

    def _offering(self, info: dict, resource: str | None) -> list[str]:
        return sorted(w for w, i in info.items() if resource is None or i.get("resources", {}).get(resource, 0) > 0)

    def _in_flight(self, kind: str, agent: str) -> bool:
        return any(w[0] == kind and w[1] == agent for w in self.runner.inflight.values())

    # ------------------------------------------------------------------ the tasks it submitted

    def handle(self, what: tuple, value: object) -> None:
        """A task the supervisor submitted finished: a trainer rebuilt, an engine started or caught up."""
        r = self.runner
        kind, agent = what[0], what[1]
        if kind == "restore":
            _, _, target, version = what
            r.location[agent] = target
            del self.restores[agent]
            self._resync(agent)
        elif kind == "replica":
            _, _, worker, version = what
            r.engines[agent].append(worker)
            r.engine_version[(agent, worker)] = version
            latest = r.versions[agent]
            if version < latest:  # an update was recorded meanwhile: catch up from its snapshot
                r._submit(worker, replica_fns.load_weights_from, r.key(agent), latest,
                          snapshots.weights_uri(self._snapshot(agent, latest)),
                          self.cfg.training.state_storage_options, what=("catchup", agent, worker, latest))
            self._open_slots(worker)
        elif kind == "catchup":
            worker = what[2]
            if (agent, worker) in r.engine_version:
                r.engine_version[(agent, worker)] = max(r.engine_version[(agent, worker)], int(value))
        self._check_recovered()

    def _resync(self, agent: str) -> None:
        """Bring the agent's engines to its recorded version from its snapshot; unblock it once they are."""
        r = self.runner
        version = r.versions[agent]
        behind = [w for w in r.engines[agent] if r.engine_version.get((agent, w), version) < version]
        if not behind:
            r.blocked[agent] = False
            return
        weights = snapshots.weights_uri(self._snapshot(agent, version))
        for worker in behind:
            r.pending_syncs[agent] += 1
            fut = r._submit(worker, replica_fns.load_weights_from, r.key(agent), version, weights,
                            self.cfg.training.state_storage_options, what=("sync", agent, worker, version))
            r.sync_deadlines[fut] = time.time() + self.cfg.rollout.sync_timeout_s

    def _check_recovered(self) -> None:
        r = self.runner
        if self.open and not self.restores and not self.pending_slots and all(r.replicas.values()) and not any(
            w[0] in ("restore", "replica") for w in r.inflight.values()
        ):
            for recovery in self.open:
                recovery.recovered_at = time.time()
            self.open.clear()

    def _check_waiting(self, now: float) -> None:
        if not self.waiting or any(w[0] in ("restore", "replica") for w in self.runner.inflight.values()):
            self.waiting_since = None
            return
        self.waiting_since = self.waiting_since or now
        if now - self.waiting_since > self.cfg.cluster.connect_timeout_s:
            need = sorted(self.restores) or sorted(a for a, reps in self.runner.replicas.items() if not reps)
            raise ClusterError(
                f"no live worker to rebuild the engines of {need} on within {self.cfg.cluster.connect_timeout_s:.0f}s "
                "(cluster.connect_timeout_s): every worker that could host them is gone; add workers to the cluster"
            )


def kill_worker_process(dask_worker: object = None) -> int:
    """Runs in a worker's nanny (``client.run(..., nanny=True)``): SIGKILL the worker process it watches.

    The nanny then starts a new worker, as after any crash. Returns the killed pid.
    """
    pid = dask_worker.pid
    os.kill(pid, signal.SIGKILL)
    return pid


async def remove_from_scheduler(address: str, dask_scheduler: object = None) -> str:
    """Runs on the scheduler: forget a worker whose nanny cannot kill it (a frozen or unreachable host)."""
    return await dask_scheduler.remove_worker(address=address, stimulus_id=f"flexmarl-hung-{time.time()}")
