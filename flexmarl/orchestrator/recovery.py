"""What a lost or hung worker's work becomes: pure decisions on the scheduler's state, no Dask, no clock.

The supervisor (``supervisor.py``) only detects: it reports lost workers with ``lost`` and the live ones with
``rebuild``. Per-request seeds make regenerated samples identical, so:

- the jobs pinned to a lost worker are given up (``Cancel``): its generation batches go back to the queue,
  its weight syncs are dropped;
- its replicas are given back: at once one to each agent left without any, on a surviving worker, and
  the rest on a new worker (a nanny's replacement) once the engines they need run there (``StartReplica``,
  loaded from the agent's snapshot of its current version; ``CatchUp`` if an update was recorded meanwhile);
- each trainer it held is rebuilt on a live training slot (``Restore``) from the agent's snapshot of the
  version the store records, and that step's micro-batches are trained again from the start: the lost worker
  took the partial gradient sum with it, so nothing is counted twice, and the result equals the uninterrupted
  step. Syncs from the lost trainer are redone from the snapshot (``Sync`` with no source). A move whose target
  was lost is given up; the trainer it would have moved is still where it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from flexmarl.orchestrator.commands import (
    ON_TRAINER, CatchUp, Cancel, InFlight, Job, JobKind, Restore, StartReplica, Sync,
)
from flexmarl.orchestrator.records import Recovery
from flexmarl.orchestrator.rollout_queues import RolloutQueues
from flexmarl.orchestrator.training_bindings import TrainingBindings

# given up with a lost trainer: what runs on it, moves and rebuilds of it, and syncs of weights from its memory
_OF_TRAINER = ON_TRAINER | {JobKind.MOVE_STATE, JobKind.JOIN, JobKind.RESTORE, JobKind.SYNC}


class RecoveryPlanner:
    """Recovery decisions on the scheduler's state: its ``rollout`` queues and ``training`` bindings, changed
    through their named operations, and its ledger of jobs in flight. Commands go out through ``emit``;
    ``touch`` tells the scheduler that decisions may have changed.

    Args:
        agents: the agents.
        rollout, training, inflight: the scheduler's state.
        emit: the scheduler's way out for commands.
        touch: ``touch(*agents)``, every agent when none is named.
        balanced: inter-agent balancing is on (a replica may move to any agent, so a worker hosting one needs
            every agent's engine).
    """

    def __init__(self, *, agents: Sequence[str], rollout: RolloutQueues, training: TrainingBindings,
                 inflight: InFlight, emit: Callable[[object], None], touch: Callable[..., None],
                 balanced: bool) -> None:
        self.agents, self.rollout, self.training, self.inflight = list(agents), rollout, training, inflight
        self.emit, self.touch, self.balanced = emit, touch, balanced
        self.restores: dict[str, int] = {}  # agent -> the version its trainer is being rebuilt at
        self.lost_replicas: Counter[str] = Counter()  # agent -> replicas lost and not given back yet
        self.pending_replicas: dict[str, list[str]] = {}  # worker -> agents whose replicas wait for engines there
        self.recoveries: list[Recovery] = []  # each recovery as it stands: started, or finished
        self.told: list[Recovery] = []  # every record in the order it happened: each started, then finished
        self._open: list[int] = []  # indexes into ``recoveries`` of those not finished

    @property
    def waiting(self) -> bool:
        """Work waits for a worker: a trainer to rebuild, or an agent without any replica."""
        return bool(self.waiting_agents())

    def waiting_agents(self) -> list[str]:
        """The agents whose work waits for a worker: those with a trainer to rebuild, else those left without any
        replica."""
        return sorted(self.restores) or sorted(a for a, reps in self.rollout.replicas.items() if not reps)

    @property
    def owed(self) -> bool:
        return bool(+self.lost_replicas)

    def workers_in_use(self) -> set[str]:
        """Workers that hold this run's engines or jobs."""
        return self.rollout.workers() | self.training.workers() | {j.worker for j in self.inflight}

    def _give_up(self, job: Job) -> None:
        if self.inflight.pop(job):
            self.emit(Cancel(job))

    # ------------------------------------------------------------------ what a lost worker held

    def lost(self, lost: set[str], recovery: Recovery) -> None:
        self._open.append(len(self.recoveries))
        self.recoveries.append(recovery)
        self.told.append(recovery)
        lost_trainers = {a for a in self.agents if self.training.location[a] in lost} | self.training.groups_hit(lost)
        for job in self.inflight:
            if job.worker not in lost:
                continue
            self._give_up(job)
            if job.kind is JobKind.GENERATE:  # generated again elsewhere: per-request seeds give the same samples
                self.rollout.requeue(job.agent, job.requests)
            elif job.kind is JobKind.SYNC:
                self.training.lost_sync(job.agent)
            elif job.kind in ON_TRAINER:  # these run where the trainer lives
                lost_trainers.add(job.agent)
            elif job.kind is JobKind.RESTORE and job.agent in self.training.sharded:  # its other ranks wait for it
                lost_trainers.add(job.agent)
        self.training.lose_workers(lost)
        self.lost_replicas.update(self.rollout.lose_workers(lost))
        for worker in lost:
            for agent in self.pending_replicas.pop(worker, []):  # replicas that waited for engines there
                self.lost_replicas[agent] += 1
        for agent in sorted(lost_trainers):
            self._lose_trainer(agent, lost)
        for agent in self.agents:
            self.training.unblock_if_idle(agent, restoring=agent in self.restores)
        self.touch()

    def _lose_trainer(self, agent: str, lost: set[str]) -> None:
        """Give up everything the agent's trainer (each rank of its group) was doing; it is rebuilt at the version
        the store records."""
        for job in self.inflight.of(agent, *_OF_TRAINER):
            self._give_up(job)
        self.restores[agent] = self.training.lose_trainer(agent, lost)

    # ------------------------------------------------------------------ rebuilding

    def rebuild(self, rollout: list[str], training: list[str], *, slot_limit: int | None,
                replicas_per_worker: int) -> bool:
        """With these live workers (by the resource they offer): add new training workers as slots, rebuild
        lost trainers and replace lost replicas (and the engines they need). True if it decided anything."""
        acted = False
        for worker in training:
            if worker not in self.training.slots and (slot_limit is None or len(self.training.slots) < slot_limit):
                self.training.add_slot(worker)
                acted = True
        # the sharded agents' new ranks form one world (they share it), joined by each agent in turn
        world = next((j.formation for j in self.inflight.of(None, JobKind.RESTORE) if j.agent in self.training.sharded),
                     None)
        for agent, version in sorted(self.restores.items()):
            if self.inflight.of(agent, JobKind.RESTORE):
                continue
            if agent in self.training.sharded:  # every new rank rebuilds its shards, together
                ranks = self.training.rebuild_ranks(agent, set(training))
                if ranks is None:
                    continue
                world = world or self.training.next_formation()
                for worker in ranks:
                    self.emit(Restore(agent, worker, version, ranks, world))
                acted = True
                continue
            target = self._pick_slot(set(training))
            if target is None:
                continue
            self.emit(Restore(agent, target, version))
            acted = True
        acted = self._replace_replicas(rollout, replicas_per_worker) or acted
        if acted:
            self.touch()
        return acted

    def _replace_replicas(self, rollout: list[str], replicas_per_worker: int) -> bool:
        """Give lost replicas back: first one to each agent left without any, on a live worker (loading the
        agent's engine there if needed), then the rest on new workers, once the engines they need run."""
        acted = False
        pending = {a for agents in self.pending_replicas.values() for a in agents}
        for agent in self.agents:
            if self.rollout.replicas[agent] or agent in pending:
                continue
            worker = self._pick_survivor(agent, rollout)
            if worker is not None:
                self.lost_replicas[agent] = max(self.lost_replicas[agent] - 1, 0)
                self._place_replica(agent, worker)
                acted = True
        ours = {w for ws in self.rollout.engines.values() for w in ws} | set(self.pending_replicas) | {
            j.worker for j in self.inflight.of(None, JobKind.START_REPLICA)}
        for worker in (w for w in rollout if w not in ours):  # a new worker (a nanny's replacement)
            debt = [a for a in self.agents for _ in range(self.lost_replicas[a])]
            if not debt:
                break
            for agent in debt[:replicas_per_worker]:
                self.lost_replicas[agent] -= 1
                self._place_replica(agent, worker)
            acted = True
        return acted

    def _engines_needed(self, agent: str) -> list[str]:
        # with inter-agent balancing a replica may move to any agent: every agent's engine must be on its worker
        return list(self.agents) if self.balanced else [agent]

    def _place_replica(self, agent: str, worker: str) -> None:
        """A replica of ``agent`` on ``worker``: at once if the engines it needs are there, else once they are."""
        self.pending_replicas.setdefault(worker, []).append(agent)
        for needed in self._engines_needed(agent):
            if worker not in self.rollout.engines[needed] and not self.inflight.of(
                    needed, JobKind.START_REPLICA, worker=worker):
                self.emit(StartReplica(needed, worker, self.training.written_version(needed)))
        self._open_replicas(worker)

    def _open_replicas(self, worker: str) -> None:
        waiting = self.pending_replicas.get(worker, [])
        for agent in list(waiting):
            if self.rollout.has_engines(worker, self._engines_needed(agent)):
                waiting.remove(agent)
                self.rollout.add_replica(agent, worker)
        if not waiting:
            self.pending_replicas.pop(worker, None)
        self.touch()

    def _pick_slot(self, live: set[str]) -> str | None:
        """The live training slot hosting the fewest agents (ties: by name)."""
        candidates = [w for w in self.training.slots if w in live]
        if not candidates:
            return None
        hosted = Counter(self.training.location[a] for a in self.agents if a not in self.restores)
        return min(candidates, key=lambda w: (hosted[w], w))

    def _pick_survivor(self, agent: str, rollout: list[str]) -> str | None:
        """A live rollout worker for a replica of ``agent``: one holding the engines it needs first, then the one
        holding fewest replicas (ties: by name)."""
        if not rollout:
            return None
        held = Counter(rep.worker for reps in self.rollout.replicas.values() for rep in reps)
        ready = [w for w in rollout if self.rollout.has_engines(w, self._engines_needed(agent))]
        return min(ready or rollout, key=lambda w: (held[w], w))

    # ------------------------------------------------------------------ the jobs it decided

    def done(self, job: Job, value: object) -> None:
        """A rebuild finished: a trainer restored, an engine started (``value``: nothing) or caught up
        (``value``: its ``WeightsLoaded``)."""
        agent = job.agent
        if job.kind is JobKind.RESTORE and self.inflight.of(agent, JobKind.RESTORE):
            return  # a sharded agent's other ranks still rebuild theirs
        if job.kind is JobKind.RESTORE:
            self.training.restored(agent, job.worker)
            del self.restores[agent]
            self._resync(agent)
        elif job.kind is JobKind.START_REPLICA:
            self.rollout.engine_started(agent, job.worker, job.version)
            latest = self.training.versions[agent]
            if job.version < latest and agent in self.training.sharded:
                self._catch_up_from_trainer(agent, job.worker, latest)
            elif job.version < latest:  # an update was recorded meanwhile: catch up from its snapshot
                self.emit(CatchUp(agent, job.worker, latest))
            self._open_replicas(job.worker)
        elif job.kind is JobKind.CATCH_UP:
            self.rollout.caught_up(agent, job.worker, value.version)
        self.touch(agent)

    def _catch_up_from_trainer(self, agent: str, worker: str, version: int) -> None:
        """A sharded agent's new engine, started at a version its run wrote, loads ``version`` from the trainer:
        its state of ``version`` may not be written (``run.snapshot_every``), and only its ranks together can
        rebuild it. Only while the agent is idle, since a blocked agent's weights are about to change or to reach
        every engine anyway (a step or a rebuild under way: its update's sync, or the rebuild's, comes next;
        syncs under way: the weights hold until the next update syncs this engine too). It stays blocked until
        the engine has them."""
        if self.training.blocked[agent]:
            return
        self.training.resync(agent, [worker])
        self.emit(Sync(agent, worker, version, self.training.location[agent]))

    def _resync(self, agent: str) -> None:
        """Bring the agent's engines to its recorded version from its snapshot; unblock it once they are."""
        version = self.training.versions[agent]
        behind = self.rollout.engines_behind(agent, version)
        self.training.resync(agent, behind)
        for worker in behind:
            self.emit(Sync(agent, worker, version, None))

    def check_recovered(self, now: float) -> None:
        """Finish the open recoveries once nothing waits to be rebuilt (``now``: the executor's clock): each gets
        a second record, with ``recovered_at``."""
        if self._open and not self.restores and not self.pending_replicas and all(
                self.rollout.replicas.values()) and not self.rebuilding():
            for i in self._open:
                self.recoveries[i] = replace(self.recoveries[i], recovered_at=now)
                self.told.append(self.recoveries[i])
            self._open.clear()

    def rebuilding(self) -> bool:
        return bool(self.inflight.of(None, JobKind.RESTORE, JobKind.START_REPLICA))
