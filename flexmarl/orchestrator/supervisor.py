"""Detects lost and hung workers; what their work becomes is decided in ``recovery.py``.

Dask's nanny restarts a killed worker process under a new address; the engines it held (rollout engines,
trainers: ``cluster/worker_state.py``) are gone, and jobs pinned to the old address would wait forever.
The supervisor compares the scheduler's workers from the pipeline's loop; a worker that left, or came back
under the same address as a new process, is lost, and ``RecoveryPlanner.lost`` decides what its work
becomes. Each poll also offers the live workers to ``RecoveryPlanner.rebuild``.

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

from distributed import Client

from flexmarl.cluster.local import ClusterError, scheduler_workers
from flexmarl.config import RunConfig
from flexmarl.orchestrator.recovery import RecoveryPlanner
from flexmarl.orchestrator.records import Recovery

POLL_S = 0.5  # how often the scheduler is asked which workers are alive
KILL_WAIT_S = 10.0  # for a hung worker's nanny to kill it, and for the scheduler to see it gone


class Supervisor:
    """Detects lost and hung workers of a pipeline and reports them to its ``recovery`` planner.

    It runs in the pipeline's own thread (``poll`` from the loop, ``restart`` on a late job), so nothing here
    needs a lock.
    """

    def __init__(self, client: Client, cfg: RunConfig, recovery: RecoveryPlanner) -> None:
        self.client, self.cfg, self.recovery = client, cfg, recovery
        self.poll_s = POLL_S
        info = self._scheduler_workers()
        self.workers = set(info)
        self.ids = {w: i.get("id") for w, i in info.items()}  # a worker restarted on the same address gets a new id
        now = time.time()
        self.heartbeats = {w: (i.get("last_seen"), now) for w, i in info.items()}
        # Workers that ran something for us. A new worker is not judged by its heartbeat before its first job
        # is done: importing torch in a fresh process can hold the interpreter for many seconds.
        self.proven = set(info)
        self.last_poll = now
        self.waiting_since: float | None = None

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
        if lost & self.recovery.workers_in_use():
            self.recovery.lost(lost, Recovery(tuple(sorted(lost)), "lost", time.time()))
            acted = True
        silent = self._silent(info, now)
        if silent:
            self.restart(silent, f"no heartbeat for {self.cfg.cluster.heartbeat_timeout_s:.0f}s "
                                 "(cluster.heartbeat_timeout_s)", TimeoutError)
            return True
        if lost or joined or self.recovery.waiting or self.recovery.owed:
            acted |= self.recovery.rebuild(
                self._offering(info, self.cfg.cluster.rollout_resource),
                self._offering(info, self.cfg.cluster.train_resource),
                slot_limit=self.cfg.training.slots, replicas_per_worker=self.cfg.rollout.replicas_per_worker)
        self.recovery.check_recovered(time.time())
        self._check_waiting(now)
        return acted

    def restart(self, workers: set[str], why: str, error: type[Exception]) -> None:
        """Have the nannies of hung ``workers`` kill them; they are then lost workers like any other.

        Raises:
            ``error``: a worker has no nanny to restart it (the message names it and ``why``).
        """
        info = self._scheduler_workers()
        alive = sorted(w for w in workers if w in info)
        orphans = [w for w in alive if not info[w].get("nanny")]
        if orphans:
            raise error(f"{why}; worker {orphans[0]} has no nanny to restart it")
        if alive:
            recovery = Recovery(tuple(alive), f"hung: {why}", time.time())
            # in a thread: a frozen host's nanny may never answer
            killer = threading.Thread(target=self.client.run, args=(kill_worker_process,),
                                      kwargs={"workers": alive, "nanny": True, "on_error": "ignore"}, daemon=True)
            killer.start()
            killer.join(KILL_WAIT_S)
            deadline = time.time() + KILL_WAIT_S
            while time.time() < deadline and self._same(alive, info):
                time.sleep(0.1)
            for worker in self._same(alive, info):  # its nanny did not kill it: the scheduler forgets it
                self.client.run_on_scheduler(remove_from_scheduler, worker)
            self.workers -= set(alive)
            for worker in alive:
                self.ids.pop(worker, None)
                self.heartbeats.pop(worker, None)
            self.recovery.lost(set(alive), recovery)
        self.poll(force=True)

    def _same(self, workers: list[str], before: dict) -> list[str]:
        """Those of ``workers`` still registered as the same process as in ``before``."""
        now = self._scheduler_workers()
        return [w for w in workers if w in now and now[w].get("id") == before[w].get("id")]

    def _silent(self, info: dict, now: float) -> set[str]:
        """Our workers whose heartbeat the scheduler has not seen for ``cluster.heartbeat_timeout_s``."""
        silent = set()
        ours = self.recovery.workers_in_use()
        for worker, i in info.items():
            seen = i.get("last_seen")
            last, since = self.heartbeats.get(worker, (None, now))
            if seen != last:
                self.heartbeats[worker] = (seen, now)
            elif worker in ours and worker in self.proven and now - since > self.cfg.cluster.heartbeat_timeout_s:
                silent.add(worker)
        return silent

    def _scheduler_workers(self) -> dict[str, dict]:
        return scheduler_workers(self.client)

    @staticmethod
    def _offering(info: dict, resource: str | None) -> list[str]:
        return sorted(w for w, i in info.items() if resource is None or i.get("resources", {}).get(resource, 0) > 0)

    def _check_waiting(self, now: float) -> None:
        if not self.recovery.waiting or self.recovery.rebuilding():
            self.waiting_since = None
            return
        self.waiting_since = self.waiting_since or now
        if now - self.waiting_since > self.cfg.cluster.connect_timeout_s:
            need = self.recovery.waiting_agents()
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
