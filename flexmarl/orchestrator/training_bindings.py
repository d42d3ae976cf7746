"""Training's half of the scheduler's state: each agent's version, its micro-batches, where its trainer lives,
and the training slot it binds for its step; and the decisions that bind slots and move states.

Agent-centric slots: an agent with training work binds a free slot and keeps it for its step. A bound agent's
next micro-batch runs on its slot. Unbound agents with work take the free slots, the one whose ready work
waited longest first, preferring the slot its state was prefetched to, then the slot that holds its state;
elsewhere its state moves there first (parked by one worker, resumed by the other). Agents still waiting get
their states prefetched to the slots likely to free next.

Trainer groups (``training.max_slots`` > 1): once no agent waits for a slot, a bound agent whose step ends
sooner on one rank more, by more than the rank costs (``SchedulePolicy.grows``, priced by what its jobs have taken:
``prices.py``), takes an idle slot more. That rank joins its group (``Join``: it resumes the
state the agent's home parks, unless it still holds a copy at the agent's version), trains whole micro-batches
of the step (each goes to the rank with the fewest queued), and the optimizer step is one ``Finish`` per rank,
a collective. The group keeps its slots until then; every rank then holds the new weights, so a rank that
trains the agent's next step too needs no copy, and the copies of ranks left out go stale and are dropped.

A sharded agent (``training.sharding: full``) holds a shard of its state on each of its ranks
(``policy.sharded_ranks``) for the whole run: it never moves, grows or shrinks, and binds all its ranks for each
step (while some are taken, the free ones wait for it). Every rank trains each micro-batch together, one
micro-batch at a time (``Train`` per rank), so the ranks' collectives run in one order; the optimizer step and
the snapshot are one job per rank too.

``TrainingBindings`` is part of ``Scheduler`` (``scheduler.py``), which reports commits, finished jobs and
recorded updates; recovery (``recovery.py``) loses and restores trainers through the named operations below.
Commands go out through the scheduler's ``emit``. An agent's training work changes only with its own state (or
a complete step), so it is asked again only for agents marked stale; ``memo=False`` asks for every agent on
every dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from flexmarl.orchestrator.commands import (
    BLOCKING, Commit, Discard, Finish, InFlight, JobKind, Join, MicroBatch, MoveState, Park, Prefetch, RecordUpdate,
    Snapshot, StoredBatch, Train,
)
from flexmarl.orchestrator.policy import GrowthPrice, SchedulePolicy, sharded_ranks
from flexmarl.orchestrator.prices import JobPrices


class TrainingBindings:
    """Versions, micro-batches, trainers' homes and slot bindings of every agent.

    Args:
        agents: the agents.
        policy: the schedule's decisions.
        slots: the training workers; agents bind them on demand.
        location: per agent, the worker holding its trainer (its home: rank 0 of its group).
        versions: per agent, the starting policy version.
        agent_wise: the agents whose advantages are normalised over the whole batch (committed together).
        inflight: the scheduler's ledger of jobs (read: whether an agent's blocking jobs are done).
        emit: the scheduler's way out for commands.
        snapshot_every: write an agent's training state after every k-th update (versions k, 2k, ... and the
            last), before it is recorded; 0: never.
        memo: keep the memo of each agent's training work (see the module docstring).
        max_slots: per agent, the most slots its trainer group may span (1 when not named).
        sharded: the agents whose trainer is sharded over their ranks.
    """

    def __init__(self, *, agents: Sequence[str], policy: SchedulePolicy, slots: Sequence[str],
                 location: dict[str, str], versions: dict[str, int], agent_wise: set[str], inflight: InFlight,
                 emit: Callable[[object], None], snapshot_every: int = 0, memo: bool = True,
                 max_slots: dict[str, int] | None = None, sharded: set[str] | None = None) -> None:
        self.agents, self.policy, self.inflight, self.emit = list(agents), policy, inflight, emit
        self.agent_wise = agent_wise
        self.snapshot_every, self.memo = snapshot_every, memo
        self.slots = sorted(set(slots))
        self.location = dict(location)
        self.versions = dict(versions)
        self.start_versions = dict(versions)  # a resumed run's: each written at its start (``Runtime``)
        self.max_slots = {a: (max_slots or {}).get(a, 1) for a in self.agents}
        self.sharded = set(sharded or ())
        # a sharded agent's ranks: fixed from the start until a lost rank makes it rebuild (``rebuild_ranks``)
        self.shard_ranks = {a: sharded_ranks(self.slots, self.max_slots[a]) for a in self.sharded}
        self.bound: dict[str, tuple[str, ...]] = {}  # agent -> its group's slots for its current step, home first
        self.copies: dict[str, dict[str, int]] = {a: {} for a in self.agents}  # other workers' trainers: version
        self.joining: dict[str, set[str]] = {a: set() for a in self.agents}  # ranks loading the state (``Join``)
        self.on_rank: dict[str, dict[str, int]] = {a: {} for a in self.agents}  # micro-batches queued per rank
        self.formations: dict[str, tuple[tuple[str, ...], int]] = {}  # agent -> (group members, formation)
        self._formed = 0
        self.parked: set[str] = set()  # agents whose state has a parked copy (or a park under way)
        self.prefetched: dict[str, str] = {}  # agent -> the slot reading its state ahead
        self.micro: dict[tuple[str, int], list[MicroBatch]] = {}
        self.complete: dict[str, set[int]] = {a: set() for a in self.agents}
        self.blocked = {a: False for a in self.agents}  # optimizer step, sync, move or rebuild under way
        self.pending_syncs = {a: 0 for a in self.agents}
        self._work_stale: set[str] = set(self.agents)  # agents whose training answer may have changed
        self._work: dict[str, tuple | None] = {}
        self.prices = JobPrices()  # what its training jobs have taken so far: the growth rule's prices

    # ------------------------------------------------------------------ micro-batches

    def add_step(self, step: int, batches: dict[str, list[MicroBatch]]) -> None:
        """The micro-batch partition of ``step``, per agent."""
        for agent, mbs in batches.items():
            self.micro[(agent, step)] = mbs
        self._work_stale.update(self.agents)

    def group_done(self, step: int, query: int) -> None:
        """Every episode of ``query`` is done: commit the micro-batches it completes."""
        for agent in self.agents:
            batches = self.micro[(agent, step)]
            mb = next(m for m in batches if query in m.queries)
            mb.done_queries.add(query)
            if agent not in self.agent_wise:
                if mb.done_queries == mb.queries:
                    self.emit(Commit(agent, step, (mb,), False))
            elif all(m.done_queries == m.queries for m in batches):
                # agent-wise normalisation needs the agent's whole batch: commit every micro-batch now
                self.emit(Commit(agent, step, tuple(batches), True))

    def committed(self, mb: MicroBatch, at: float, stored: StoredBatch | None, *, trainable: bool,
                  consumed: bool) -> None:
        mb.committed, mb.committed_at, mb.stored = True, at, stored
        mb.trainable = trainable and not consumed
        if not mb.trainable:
            mb.submitted = mb.trained = True
        self._work_stale.add(mb.agent)
        if all(m.committed for m in self.micro[(mb.agent, mb.step)]):
            self.complete[mb.agent].add(mb.step)
            self._work_stale.update(self.agents)  # may_train may read every agent's complete steps (sync does)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self) -> None:
        """Send due micro-batches and optimizer steps to bound slots; bind free slots; prefetch the rest."""
        for agent in (self._work_stale if self.memo else self.agents):
            self._work[agent] = self._training_work(agent)
        self._work_stale.clear()
        work = {a: w for a in self.agents if (w := self._work[a])}
        for agent, (_, mb) in sorted(work.items()):
            if self.bound.get(agent):
                self._run_training(agent, mb)
        taken = {w for members in self.bound.values() for w in members}
        free = [w for w in self.slots if w not in taken]
        waiting = {a: w for a, w in work.items() if not self.bound.get(a)}
        while free and waiting:
            agent = self.policy.pick_agent({a: w[0] for a, w in waiting.items()})
            _, mb = waiting.pop(agent)
            if agent in self.sharded:
                ranks = self.ranks(agent)
                if set(ranks) <= set(free):
                    self.bound[agent] = ranks
                    self._run_training(agent, mb)
                free = [w for w in free if w not in ranks]  # bound, or kept for it until the others free
                continue
            fresh = self._fresh(agent)
            target = self.policy.pick_slot(free, self.prefetched.get(agent), self.location[agent], *fresh)
            free.remove(target)
            self.bound[agent] = (target,)
            if target == self.location[agent] or target in fresh:
                if target != self.location[agent]:
                    self._rehome(agent, target)
                self._stay(agent)
                self._run_training(agent, mb)
            else:
                self._move_state(agent, target)
        waiting = {a: w for a, w in waiting.items() if a not in self.sharded}  # its state never moves
        if waiting:
            self._prefetch_states(waiting)
        else:
            self._grow(free)

    def ranks(self, agent: str) -> tuple[str, ...]:
        """The slots a sharded agent's trainer spans (its home first)."""
        return self.shard_ranks[agent]

    def rebuild_ranks(self, agent: str, live: set[str]) -> tuple[str, ...] | None:
        """A sharded agent's ranks for the rebuild of its trainer, from the ``live`` slots; None until there are
        enough (a lost worker's replacement is not a slot yet)."""
        slots = [w for w in self.slots if w in live]
        if len(slots) < self.max_slots[agent]:
            return None
        self.shard_ranks[agent] = sharded_ranks(slots, self.max_slots[agent])
        return self.shard_ranks[agent]

    def next_formation(self) -> int:
        """A number no formation of a group or world has had in this run."""
        self._formed += 1
        return self._formed

    def _fresh(self, agent: str) -> list[str]:
        """Workers besides the agent's home whose trainer copy is at its version (and not in a step)."""
        version = self.versions[agent]
        return sorted(w for w, v in self.copies[agent].items() if v == version and w not in self.joining[agent])

    def _rehome(self, agent: str, worker: str) -> None:
        """The agent's home becomes ``worker``, which holds a copy at its version; the old home keeps its own."""
        del self.copies[agent][worker]
        self.copies[agent][self.location[agent]] = self.versions[agent]
        self.location[agent] = worker

    def _grow(self, free: list[str]) -> None:
        """No agent waits for a slot: give idle slots to the bound agents with the most of their step unsent
        (``SchedulePolicy.grows``, priced by the jobs seen so far), one slot per agent per turn. A new rank takes
        a slot holding a copy at the agent's version, else one that is home to no agent training this step,
        else the first idle one."""
        unsent = {a: sum(not m.submitted for m in self.micro.get((a, self.versions[a]), []))
                  for a, members in self.bound.items() if members and not self.blocked[a] and a not in self.sharded}
        for agent in sorted(unsent, key=lambda a: (-unsent[a], a)):
            if not free:
                return
            members = self.bound[agent]
            fresh = [w for w in self._fresh(agent) if w in free]
            displaced = {w: self._displaced(agent, w) for w in free}
            target = self.policy.pick_slot(free, *fresh, *(w for w in free if not displaced[w]))
            copy_held = target in fresh
            price = self._growth_price(agent, displaced[target], len(members), copy_held=copy_held)
            if price is None and displaced[target]:
                continue  # a slot that is home to an agent training this step is taken on prices only, never by count
            if not self.policy.grows(unsent[agent], len(members), self.max_slots[agent], copy_held=copy_held,
                                     price=price):
                continue
            free.remove(target)
            self.bound[agent] = (*members, target)
            self._work_stale.add(agent)
            if not copy_held:
                self._park(agent)
                self.joining[agent].add(target)
                self.emit(Join(agent, target, self.location[agent]))

    def _displaced(self, agent: str, worker: str) -> list[str]:
        """The other agents whose trainer lives on ``worker``, unbound, with micro-batches of their step still to
        train: a rank of ``agent`` there makes them move elsewhere (or wait) when they bind."""
        return [a for a, home in self.location.items()
                if home == worker and a != agent and not self.bound.get(a) and a not in self.sharded
                and any(not m.trained for m in self.micro.get((a, self.versions[a]), []))]

    def _growth_price(self, agent: str, displaced: list[str], ranks: int, *, copy_held: bool) -> GrowthPrice | None:
        """What one more rank of ``agent`` costs, from the jobs seen so far, where it makes the ``displaced`` agents
        move; None while a cost of the agent's own has not been seen (the rule then counts micro-batches). A
        displaced agent whose move was never seen is priced infinite: another agent's cost is not guessed."""
        prices = self.prices
        moves = [prices.move_s(other) for other in displaced]
        displaced_s = math.inf if None in moves else sum(moves)
        micro_batch_s = prices.of(agent, "train")
        park_s = join_s = 0.0
        if not copy_held:
            park, resume = prices.of(agent, "park"), prices.of(agent, "resume")
            if park is None or resume is None:
                return None
            park_s = 0.0 if agent in self.parked else park  # the home parks (unless it has) instead of training
            join_s = park_s + resume  # the new rank waits for that park, then resumes
        if micro_batch_s is None:
            return None
        return GrowthPrice(micro_batch_s, park_s, join_s, prices.reduce_s(agent, ranks), displaced_s)

    def _training_work(self, agent: str) -> tuple[float, MicroBatch | None] | None:
        """(ready since, micro-batch to train or None for the optimizer step), or None when nothing is due.

        The policy decides (``training_work``).
        """
        step = self.versions[agent]  # the update to step + 1 consumes step's batch
        if self.blocked[agent] or (agent, step) not in self.micro:
            return None
        ranks = [w for w in self.bound.get(agent, ()) if w not in self.joining[agent]]
        queued = min((self.on_rank[agent].get(w, 0) for w in ranks), default=0)  # on its least queued rank
        work = self.policy.training_work(agent, step, self.micro[(agent, step)], self.complete,
                                         queued=queued, ranks=len(ranks))
        if work is not None and work[1] is None and self.joining[agent]:
            return None  # the optimizer step is every rank's: it waits for the ranks still joining
        return work

    def _slots_by_release(self) -> list[str]:
        """Bound slots, the one likely to free first first: its agent has the fewest micro-batches left."""
        left = {}
        for agent, members in self.bound.items():
            for worker in members:
                left[worker] = sum(not m.trained for m in self.micro.get((agent, self.versions[agent]), []))
        return sorted(left, key=lambda w: (left[w], w))

    def _prefetch_states(self, waiting: dict[str, tuple[float, MicroBatch | None]]) -> None:
        """Every slot is bound: read the states of the agents that will bind next into the host memory of the
        slots likely to free first (in the same order), while those slots train. The move then skips the read.
        """
        order, pending = [], {a: w[0] for a, w in waiting.items()}
        while pending:
            order.append(self.policy.pick_agent(pending))
            del pending[order[-1]]
        taken = set(self.prefetched.values())
        slots = [w for w in self._slots_by_release() if w not in taken]
        for agent in order:
            if agent in self.prefetched:
                continue
            if not slots:
                break
            target = slots.pop(0)
            if target == self.location[agent]:
                continue  # its state is already there
            self._park(agent)
            self.prefetched[agent] = target
            self.emit(Prefetch(agent, target))

    def _park(self, agent: str) -> None:
        """Write the agent's state from its worker to the state store, once.

        Its trainer stays on that worker until the state is resumed elsewhere, so a wrong guess of the slot
        that frees first costs only the write when the agent then binds its own slot again.
        """
        if agent not in self.parked:
            self.parked.add(agent)
            self.emit(Park(agent, self.location[agent]))

    def _stay(self, agent: str) -> None:
        """The agent binds the slot that holds its trainer: a parked copy or a read ahead is not needed."""
        self.parked.discard(agent)  # it trains here next, so the copy goes stale (the next park replaces it)
        prefetched = self.prefetched.pop(agent, None)
        if prefetched is not None:
            self.emit(Discard(agent, prefetched))

    def _run_training(self, agent: str, mb: MicroBatch | None) -> None:
        """Send ``mb`` to the rank of the agent's group with the fewest queued (ties: in rank order), or the
        optimizer step (None) to every rank."""
        self._work_stale.add(agent)
        members = self.bound[agent]
        if mb is not None and agent in self.sharded:
            if not any(self.on_rank[agent].values()):  # one at a time: every rank's collectives in one order
                mb.submitted = True
                for worker in members:
                    self.on_rank[agent][worker] = 1
                    self.emit(Train(agent, worker, mb))
            return
        if mb is not None:
            queued = self.on_rank[agent]
            worker = min((w for w in members if w not in self.joining[agent]), key=lambda w: queued.get(w, 0))
            mb.submitted = True
            queued[worker] = queued.get(worker, 0) + 1
            self.emit(Train(agent, worker, mb))
            return
        self.blocked[agent] = True
        if len(members) == 1:
            self.emit(Finish(agent, members[0], self.versions[agent]))
            return
        if self.formations.get(agent, ((), 0))[0] != members:
            self.formations[agent] = (members, self.next_formation())
        for worker in members:
            self.emit(Finish(agent, worker, self.versions[agent], members, self.formations[agent][1]))

    def _move_state(self, agent: str, target: str) -> None:
        """Move the agent's state to ``target``: parked by its old worker (unless it already is), read by
        ``target`` (unless prefetched there)."""
        self._work_stale.add(agent)
        self.blocked[agent] = True
        self._park(agent)
        where = self.prefetched.pop(agent, None)
        if where is not None and where != target:  # the guess of the next free slot was wrong: free that copy
            self.emit(Discard(agent, where))
        self.emit(MoveState(agent, target, self.location[agent], where == target))

    # ------------------------------------------------------------------ what finished

    def trained(self, job: Train) -> None:
        self.on_rank[job.agent][job.worker] -= 1
        # a sharded agent's micro-batch is trained once every rank has trained its part
        job.batch.trained = job.agent not in self.sharded or not any(self.on_rank[job.agent].values())
        self._work_stale.add(job.agent)

    def joined(self, job: Join) -> None:
        """A rank holds the agent's state of its step's start and may train its micro-batches."""
        self.joining[job.agent].discard(job.worker)
        self.copies[job.agent][job.worker] = self.versions[job.agent]
        self._work_stale.add(job.agent)

    def step_finished(self, job: Finish) -> None:
        """The optimizer step is done on every rank: the slots are free at once; the agent stays blocked until its
        replicas have the weights. Its state is written first on snapshot versions, then the update is recorded.
        The group's other ranks hold the new weights too; copies elsewhere are stale and dropped."""
        agent = job.agent
        if self.inflight.of(agent, JobKind.FINISH):  # another rank's part of the collective step still runs
            return
        members = self.bound.pop(agent)
        self._work_stale.add(agent)
        if len(members) == 1:
            # a formation is kept only from one step of its group to the next: a rank whose copy is dropped (below)
            # drops its process group, and a later group of the same members forms afresh, under a new name
            self.formations.pop(agent, None)
        version = job.step + 1
        for worker in sorted(self.copies[agent]):
            if worker in members:
                self.copies[agent][worker] = version
            else:
                del self.copies[agent][worker]
                self.emit(Discard(agent, worker, trainer=True))
        self.parked.discard(agent)  # a copy of the step's start, parked for a joining rank
        if self.snapshot_every and (version % self.snapshot_every == 0 or version == self.policy.steps):
            # copied before the update is recorded; other versions are rebuilt from it by replay when needed. The
            # last is written before the run may end; the others are written while the worker works on
            if agent in self.sharded:  # each rank writes its shards, together
                for worker in self.ranks(agent):
                    self.emit(Snapshot(agent, worker, job.step))
            else:
                self.emit(Snapshot(agent, self.location[agent], job.step, background=version != self.policy.steps))
        else:
            self.emit(RecordUpdate(job.agent, job.step))

    def snapshot_written(self, job: Snapshot) -> None:
        if not self.inflight.of(job.agent, JobKind.SNAPSHOT):  # every rank's part of a sharded agent's is written
            self.emit(RecordUpdate(job.agent, job.step))

    def updated(self, agent: str, step: int, version: int, syncs: int) -> list[MicroBatch]:
        """The update of ``step`` is recorded at ``version``; ``syncs`` weight syncs carry it to the engines.
        Returns the step's micro-batches."""
        self.versions[agent] = version
        self.pending_syncs[agent] += syncs
        self._work_stale.add(agent)
        return self.micro.pop((agent, step))

    def synced(self, agent: str, *, restoring: bool) -> None:
        """One of the agent's engines has its weights; the last one unblocks it (unless its trainer is being
        rebuilt)."""
        self.pending_syncs[agent] -= 1
        if self.pending_syncs[agent] == 0 and not restoring:
            self.blocked[agent] = False
        self._work_stale.add(agent)

    def state_moved(self, job: MoveState) -> None:
        if self.max_slots[job.agent] > 1:  # the old home's trainer is a copy at the agent's version: a rank to be
            self.copies[job.agent][job.source] = self.versions[job.agent]
        else:
            self.emit(Discard(job.agent, job.source, trainer=True))  # before any later move back there
        self.copies[job.agent].pop(job.worker, None)
        self.location[job.agent] = job.worker
        self.blocked[job.agent] = False
        self.parked.discard(job.agent)
        self._work_stale.add(job.agent)

    def touch(self, agents: Sequence[str]) -> None:
        self._work_stale.update(agents)

    def is_finished(self, target: int) -> bool:
        return all(v >= target for v in self.versions.values())

    def blocking(self, agent: str) -> bool:
        return bool(self.inflight.of(agent, *BLOCKING))

    # ------------------------------------------------------------------ workers lost and rebuilt (recovery)

    def workers(self) -> set[str]:
        """Training slots and the workers holding a trainer."""
        return set(self.slots) | set(self.location.values()) | {w for c in self.copies.values() for w in c}

    def groups_hit(self, lost: set[str]) -> set[str]:
        """The agents whose trainer group for the current step has a rank on a ``lost`` worker: the step's
        gradient sum is spread over the ranks, so the whole step is redone, as for a lost home. A sharded agent's
        trainer is hit whenever one of its ranks is: its state is spread over them."""
        return ({a for a, members in self.bound.items() if set(members) & lost}
                | {a for a, ranks in self.shard_ranks.items() if set(ranks) & lost})

    def lose_workers(self, lost: set[str]) -> None:
        """Forget ``lost`` slots, the trainer copies and what was prefetched there; a move to one is given up (the
        trainer is still where it was)."""
        for agent in self.agents:
            if self.bound.get(agent) and self.bound[agent][0] in lost:
                self.bound[agent] = ()
            for worker in lost:
                self.copies[agent].pop(worker, None)
        self.prefetched = {a: w for a, w in self.prefetched.items() if w not in lost}
        self.slots = [w for w in self.slots if w not in lost]

    def lose_trainer(self, agent: str, lost: set[str]) -> int:
        """Everything the agent's trainer was doing is gone (``lost``: the workers that took it): its step is
        trained again from its start, once the trainer is rebuilt at the version the store records (returned).
        What the group's live ranks hold of the step is dropped: the home's trainer too, where it lives on."""
        self.pending_syncs[agent] = 0
        version = self.versions[agent]
        for mb in self.micro.get((agent, version), []):  # the step is trained again, on the state of its start
            if mb.committed and mb.trainable:
                mb.submitted = mb.trained = False
        self.bound[agent] = ()
        self.on_rank[agent].clear()
        self.joining[agent].clear()
        self.formations.pop(agent, None)
        live = sorted(self.copies[agent]) + ([self.location[agent]] if self.location[agent] not in lost else [])
        if agent in self.sharded:  # the other ranks' shards: their world lost a member
            live += [w for w in self.shard_ranks[agent][1:] if w not in lost]
        for worker in live:  # mid-step, or past the version the store records
            self.emit(Discard(agent, worker, trainer=True))
        self.copies[agent].clear()
        self.blocked[agent] = True
        self.parked.discard(agent)  # written by the lost trainer, maybe only in part
        prefetched = self.prefetched.pop(agent, None)
        if prefetched is not None:
            self.emit(Discard(agent, prefetched))
        return version

    def lost_sync(self, agent: str) -> None:
        self.pending_syncs[agent] -= 1

    def unblock_if_idle(self, agent: str, *, restoring: bool) -> None:
        if restoring or not self.blocked[agent] or self.pending_syncs[agent] > 0:
            return
        if not self.blocking(agent):
            self.blocked[agent] = False

    def add_slot(self, worker: str) -> None:
        self.slots = sorted([*self.slots, worker])

    def restored(self, agent: str, worker: str) -> None:
        self.location[agent] = self.shard_ranks[agent][0] if agent in self.sharded else worker

    def resync(self, agent: str, behind: Sequence[str]) -> None:
        """The trainer's version must reach the engines ``behind`` (after a rebuild, from its snapshot; a sharded
        agent's new engine, from the trainer): the agent is blocked until they have it, unblocked at once if none
        is behind."""
        self.blocked[agent] = bool(behind)
        self.pending_syncs[agent] += len(behind)

    def written_version(self, agent: str) -> int:
        """The version a new engine of ``agent`` starts from: its current one, or for a sharded agent the
        newest its run wrote (kept by the pruning until a newer one is), since only its ranks together can
        rebuild a state the run did not write. It then catches up from the trainer. Written are the versions on
        this attempt's schedule (``snapshot_every``) and the one it started at; not those of an earlier attempt's
        schedule, which a resume with another ``snapshot_every`` does not share."""
        version = self.versions[agent]
        if agent in self.sharded and self.snapshot_every:
            return max(version - version % self.snapshot_every, self.start_versions[agent])
        return version
