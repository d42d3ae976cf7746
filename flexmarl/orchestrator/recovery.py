"""What a lost or hung worker's work becomes: pure decisions on the scheduler's state, no Dask, no clock.

The supervisor (``supervisor.py``) only detects: it reports lost workers with ``lost`` and the live ones with
``rebuild``. Per-request seeds make regenerated samples identical, so:

- the tasks pinned to a lost worker are given up (``Cancel``): its generation batches go back to the queue,
  its weight syncs are dropped;
- its replica slots are given back: at once one to each agent left without any, on a surviving worker, and
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
from flexmarl.orchestrator.records import Recovery
from flexmarl.orchestrator.tasks import (
    ON_TRAINER, CatchUp, Cancel, Discard, Restore, StartReplica, Sync, Task, TaskKind,
)
from flexmarl.rollout.balancer import Replica

# given up with a lost trainer: what runs on it, moves and rebuilds of it, and syncs of weights from its memory
_OF_TRAINER = ON_TRAINER | {TaskKind.RESUME, TaskKind.RESTORE, TaskKind.SYNC}


class RecoveryPlanner:
    """Recovery decisions on the state of ``scheduler`` (a ``Scheduler``, which builds this planner: not
    imported here, so that the two modules do not import each other); commands go to its outbox."""

    def __init__(self, scheduler) -> None:  # noqa: ANN001 - a Scheduler, see above
        self.s = scheduler
        self.restores: dict[str, int] = {}  # agent -> the version its trainer is being rebuilt at
        self.lost_slots: Counter[str] = Counter()  # agent -> replica slots lost and not given back yet
        self.pending_slots: dict[str, list[str]] = {}  # worker -> agents whose slots wait for engines there
        self.recoveries: list[Recovery] = []
        self.open: list[Recovery] = []

    @property
    def waiting(self) -> bool:
        """Work waits for a worker: a trainer to rebuild, or an agent without any replica slot."""
        return bool(self.restores) or any(not reps for reps in self.s.replicas.values())

    @property
    def owed(self) -> bool:
        return bool(+self.lost_slots)

    def workers_in_use(self) -> set[str]:
        """Workers that hold this run's engines or tasks."""
        s = self.s
        held = {rep.worker for reps in s.replicas.values() for rep in reps}
        held |= {w for ws in s.engines.values() for w in ws}
        return held | set(s.slots) | set(s.location.values()) | {t.worker for t in s.inflight}

    def _give_up(self, task: Task) -> None:
        if self.s.inflight.pop(task):
            self.s.outbox.append(Cancel(task))

    # ------------------------------------------------------------------ what a lost worker held

    def lost(self, lost: set[str], recovery: Recovery) -> None:
        s = self.s
        self.recoveries.append(recovery)
        self.open.append(recovery)
        lost_trainers = {a for a in s.agents if s.location[a] in lost}
        for task in s.inflight:
            if task.worker not in lost:
                continue
            self._give_up(task)
            if task.kind is TaskKind.GENERATE:  # generated again elsewhere: per-request seeds give the same samples
                for r in task.requests:
                    s._enqueue(r.step, r.episode, r.node)
            elif task.kind is TaskKind.SYNC:
                s.pending_syncs[task.agent] -= 1
            elif task.kind in ON_TRAINER:  # these run where the trainer lives
                lost_trainers.add(task.agent)
        for agent in s.agents:
            if s.bound.get(agent) in lost:  # a move to it was under way: the trainer is still where it was
                s.bound[agent] = None
            s.engines[agent] = [w for w in s.engines[agent] if w not in lost]
            self.lost_slots[agent] += sum(rep.worker in lost for rep in s.replicas[agent])
            s.replicas[agent][:] = [rep for rep in s.replicas[agent] if rep.worker not in lost]
        for worker in lost:
            s.outstanding_tokens.pop(worker, None)
            for agent in self.pending_slots.pop(worker, []):  # slots that waited for engines there
                self.lost_slots[agent] += 1
        s.engine_version = {k: v for k, v in s.engine_version.items() if k[1] not in lost}
        s.prefetched = {a: w for a, w in s.prefetched.items() if w not in lost}
        s.slots = [w for w in s.slots if w not in lost]
        for agent in sorted(lost_trainers):
            self._lose_trainer(agent)
        for agent in s.agents:
            self._unblock_if_idle(agent)
        s.touch()

    def _lose_trainer(self, agent: str) -> None:
        """Give up everything the agent's trainer was doing; it is rebuilt at the version the store records."""
        s = self.s
        for task in s.inflight.of(agent, *_OF_TRAINER):
            self._give_up(task)
        s.pending_syncs[agent] = 0
        version = s.versions[agent]
        for mb in s.micro.get((agent, version), []):  # the step is trained again, on the state of its start
            if mb.committed and mb.trainable:
                mb.submitted = mb.trained = False
        s.queued[agent] = 0
        s.bound[agent] = None
        s.blocked[agent] = True
        s.parked.discard(agent)  # written by the lost trainer, maybe only in part
        prefetched = s.prefetched.pop(agent, None)
        if prefetched is not None:
            s.outbox.append(Discard(agent, prefetched))
        self.restores[agent] = version

    def _unblock_if_idle(self, agent: str) -> None:
        s = self.s
        if agent in self.restores or not s.blocked[agent] or s.pending_syncs[agent] > 0:
            return
        if not s.blocking(agent):
            s.blocked[agent] = False

    # ------------------------------------------------------------------ rebuilding

    def rebuild(self, rollout: list[str], training: list[str], *, slot_limit: int | None,
                slots_per_worker: int) -> bool:
        """With these live workers (by the resource they offer): add new training workers as slots, rebuild
        lost trainers and replace lost replica slots (and the engines they need). True if it decided anything."""
        s = self.s
        acted = False
        for worker in training:
            if worker not in s.slots and (slot_limit is None or len(s.slots) < slot_limit):
                s.slots = sorted([*s.slots, worker])
                acted = True
        for agent, version in sorted(self.restores.items()):
            if s.inflight.of(agent, TaskKind.RESTORE):
                continue
            target = self._pick_slot(set(training))
            if target is None:
                continue
            s._emit(Restore(agent, target, version))
            acted = True
        acted = self._replace_slots(rollout, slots_per_worker) or acted
        if acted:
            s.touch()
        return acted

    def _replace_slots(self, rollout: list[str], slots_per_worker: int) -> bool:
        """Give lost replica slots back: first one to each agent left without any, on a live worker (loading
        the agent's engine there if needed), then the rest on new workers, once the engines they need run."""
        s = self.s
        acted = False
        pending = {a for agents in self.pending_slots.values() for a in agents}
        for agent in s.agents:
            if s.replicas[agent] or agent in pending:
                continue
            worker = self._pick_survivor(agent, rollout)
            if worker is not None:
                self.lost_slots[agent] = max(self.lost_slots[agent] - 1, 0)
                self._place_slot(agent, worker)
                acted = True
        ours = {w for ws in s.engines.values() for w in ws} | set(self.pending_slots) | {
            t.worker for t in s.inflight.of(None, TaskKind.START_REPLICA)}
        for worker in (w for w in rollout if w not in ours):  # a new worker (a nanny's replacement)
            debt = [a for a in s.agents for _ in range(self.lost_slots[a])]
            if not debt:
                break
            for agent in debt[:slots_per_worker]:
                self.lost_slots[agent] -= 1
                self._place_slot(agent, worker)
            acted = True
        return acted

    def _engines_needed(self, agent: str) -> list[str]:
        # with inter-agent balancing a slot may move to any agent: every agent's engine must be on its worker
        return list(self.s.agents) if self.s.balancer is not None else [agent]

    def _place_slot(self, agent: str, worker: str) -> None:
        """A slot of ``agent`` on ``worker``: at once if the engines it needs are there, else once they are."""
        s = self.s
        self.pending_slots.setdefault(worker, []).append(agent)
        for needed in self._engines_needed(agent):
            if worker not in s.engines[needed] and not s.inflight.of(needed, TaskKind.START_REPLICA, worker=worker):
                s._emit(StartReplica(needed, worker, s.versions[needed]))
        self._open_slots(worker)

    def _open_slots(self, worker: str) -> None:
        s = self.s
        waiting = self.pending_slots.get(worker, [])
        for agent in list(waiting):
            if all(worker in s.engines[a] for a in self._engines_needed(agent)):
                waiting.remove(agent)
                s.replicas[agent].append(Replica(agent, worker))
        if not waiting:
            self.pending_slots.pop(worker, None)
        s.touch()

    def _pick_slot(self, live: set[str]) -> str | None:
        """The live training slot hosting the fewest agents (ties: by name)."""
        s = self.s
        candidates = [w for w in s.slots if w in live]
        if not candidates:
            return None
        hosted = Counter(s.location[a] for a in s.agents if a not in self.restores)
        return min(candidates, key=lambda w: (hosted[w], w))

    def _pick_survivor(self, agent: str, rollout: list[str]) -> str | None:
        """A live rollout worker for a slot of ``agent``: one holding the engines it needs first, then the one
        holding fewest slots (ties: by name)."""
        s = self.s
        if not rollout:
            return None
        held = Counter(rep.worker for reps in s.replicas.values() for rep in reps)
        ready = [w for w in rollout if all(w in s.engines[a] for a in self._engines_needed(agent))]
        return min(ready or rollout, key=lambda w: (held[w], w))

    # ------------------------------------------------------------------ the tasks it decided

    def done(self, task: Task, value: object) -> None:
        """A rebuild finished: a trainer restored, an engine started (``value``: nothing) or caught up
        (``value``: the version it reports)."""
        s = self.s
        agent = task.agent
        if task.kind is TaskKind.RESTORE:
            s.location[agent] = task.worker
            del self.restores[agent]
            self._resync(agent)
        elif task.kind is TaskKind.START_REPLICA:
            s.engines[agent].append(task.worker)
            s.engine_version[(agent, task.worker)] = task.version
            latest = s.versions[agent]
            if task.version < latest:  # an update was recorded meanwhile: catch up from its snapshot
                s._emit(CatchUp(agent, task.worker, latest))
            self._open_slots(task.worker)
        elif task.kind is TaskKind.CATCH_UP:
            if (agent, task.worker) in s.engine_version:
                s.engine_version[(agent, task.worker)] = max(s.engine_version[(agent, task.worker)], int(value))
        s.touch(agent)

    def _resync(self, agent: str) -> None:
        """Bring the agent's engines to its recorded version from its snapshot; unblock it once they are."""
        s = self.s
        version = s.versions[agent]
        behind = [w for w in s.engines[agent] if s.engine_version.get((agent, w), version) < version]
        if not behind:
            s.blocked[agent] = False
            return
        for worker in behind:
            s.pending_syncs[agent] += 1
            s._emit(Sync(agent, worker, version, None))

    def check_recovered(self, now: float) -> None:
        """Close the open recoveries once nothing waits to be rebuilt (``now``: the executor's clock)."""
        s = self.s
        if self.open and not self.restores and not self.pending_slots and all(s.replicas.values()) and not (
                s.inflight.of(None, TaskKind.RESTORE, TaskKind.START_REPLICA)):
            for recovery in self.open:
                recovery.recovered_at = now
            self.open.clear()

    def rebuilding(self) -> bool:
        return bool(self.s.inflight.of(None, TaskKind.RESTORE, TaskKind.START_REPLICA))
