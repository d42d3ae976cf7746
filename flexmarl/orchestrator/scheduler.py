"""The pipeline's scheduling core: events in, typed commands out; no Dask, no clock, no I/O.

One ``Scheduler`` holds everything the schedule is made of: the admitted steps and their episodes' progress
through the MEG, each agent's waiting requests, the replica slots (and the inter-agent balancer that moves
them), the micro-batch partition and its commits, the agents' training slots, prefetches and versions, and
the ``InFlight`` ledger of worker tasks. Every decision is asked of ``SchedulePolicy``, ``micro_batch_of`` and
``InterAgentBalancer``. Two executors drive it: the Dask runtime (``pipeline.py``) and the simulated clock
(``flexmarl/sim/engine.py``); they carry the commands out (``tasks.py``) and report what happened, and neither
decides anything the other does not. What a lost worker's work becomes is ``recovery.py``, on this state.

An executor's turn: ``admissible()`` / ``open_step`` / ``start_step`` for each new step, ``dispatch(now)``,
then one event (``done``, ``node_done``, ``committed``, ``updated``); after each, it carries out ``drain()``.
``now`` is the executor's clock, in seconds: the balancer's cooldowns and the queue trace read it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

from flexmarl.meg.graph import ExpandedGraph, sample_id
from flexmarl.orchestrator.policy import SchedulePolicy, micro_batch_of
from flexmarl.orchestrator.recovery import RecoveryPlanner
from flexmarl.orchestrator.slots import TrainingDispatch
from flexmarl.orchestrator.tasks import (
    BLOCKING, Commit, Discard, Finish, Generate, GroupDone, InFlight, MicroBatch, RecordUpdate, Replay, Request,
    Resume, Snapshot, StepDone, Sync, Task, TaskKind, Train,
)
from flexmarl.rollout.balancer import InterAgentBalancer, Replica, adds_capacity, move_slot


@dataclass
class StepState:
    step: int
    input_ids: list[str]
    done: list[set[str]]  # per episode: its nodes done or skipped
    queued: list[set[str]]  # per episode: its nodes enqueued so far
    done_in_group: list[int]  # per query: finished episodes
    done_groups: int = 0
    finished_nodes: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # layer -> count


@dataclass(frozen=True)
class AgentShape:
    """What the scheduler needs to know of one agent."""

    micro_batch_size: int  # samples per micro-batch (rounded to whole groups by ``micro_batch_of``)
    max_new_tokens: int  # the most one request generates
    batch_limit: int  # most requests in one generation batch
    agent_wise: bool = False  # ``advantage: agent``: the whole batch is normalised (and committed) together


class Scheduler(TrainingDispatch):
    """See the module docstring.

    Args:
        policy: the schedule's decisions.
        graph: the expanded MEG (copies and loops unrolled).
        agents: per agent, its shape.
        queries_per_step, group_size: the global batch.
        rollout_slots: replica slots as (worker, agent it serves first).
        engines: per agent, the workers holding its rollout engine (each gets the agent's weight syncs).
        slots: the training workers; agents bind them on demand.
        location: per agent, the worker holding its trainer.
        versions: per agent, the starting policy version.
        balancer: inter-agent balancing, or None.
        train: False samples and commits the steps without training (the rollout benchmark).
        snapshot_every: write an agent's training state after every k-th update (versions k, 2k, ... and the
            last), before it is recorded; 0: never.
    """

    def __init__(self, *, policy: SchedulePolicy, graph: ExpandedGraph, agents: dict[str, AgentShape],
                 queries_per_step: int, group_size: int, rollout_slots: Sequence[tuple[str, str]],
                 engines: dict[str, list[str]], slots: Sequence[str], location: dict[str, str],
                 versions: dict[str, int], balancer: InterAgentBalancer | None = None, train: bool = True,
                 snapshot_every: int = 0) -> None:
        self.policy, self.graph, self.shape = policy, graph, agents
        self.agents = list(agents)
        self.queries_per_step, self.group_size = queries_per_step, group_size
        self.train, self.snapshot_every, self.balancer = train, snapshot_every, balancer
        self.order = graph.order()
        self.turn = {n: i for i, n in enumerate(self.order)}
        self.agent_of = {n.name: n.agent for n in graph.nodes}
        self.parents = {n: graph.parents(n) for n in self.order}
        self.children = {n: graph.children(n) for n in self.order}
        self.layer: dict[str, int] = {}  # longest path from a root: the layered (sync) schedule's stages
        for node in self.order:
            self.layer[node] = 1 + max((self.layer[p] for p in self.parents[node]), default=-1)
        self.roots = [n for n in self.order if not self.parents[n]]
        self.nodes_of = {a: [n for n in self.order if self.agent_of[n] == a] for a in self.agents}
        per_layer: dict[int, int] = defaultdict(int)
        for node in self.order:
            per_layer[self.layer[node]] += 1
        self.needed = {k: queries_per_step * group_size * c for k, c in per_layer.items()}

        self.replicas: dict[str, list[Replica]] = {a: [] for a in self.agents}
        for worker, agent in rollout_slots:
            self.replicas[agent].append(Replica(agent, worker))
        self.engines = {a: list(ws) for a, ws in engines.items()}
        self.engine_version = {(a, w): versions[a] for a, ws in engines.items() for w in ws}
        self.outstanding_tokens: dict[str, int] = defaultdict(int)  # per worker: tokens of batches sent to it
        self.slots = sorted(set(slots))
        self.location = dict(location)
        self.versions = dict(versions)
        self.bound: dict[str, str | None] = {}  # agent -> the slot it holds for its current step
        self.parked: set[str] = set()  # agents whose state has a parked copy (or a park under way)
        self.prefetched: dict[str, str] = {}  # agent -> the slot reading its state ahead
        self.inflight = InFlight()
        self.outbox: deque = deque()

        self.steps: dict[int, StepState] = {}
        self.next_step = min(self.versions.values())
        self.resume_until = max(self.versions.values())  # steps some agent has trained: admitted in any mode
        self.waiting: dict[str, list[Request]] = {a: [] for a in self.agents}
        self.micro: dict[tuple[str, int], list[MicroBatch]] = {}
        self.complete: dict[str, set[int]] = {a: set() for a in self.agents}
        self.queued = {a: 0 for a in self.agents}  # micro-batches sent to the agent's slot
        self.blocked = {a: False for a in self.agents}  # optimizer step, sync, move or rebuild under way
        self.pending_syncs = {a: 0 for a in self.agents}
        self.replay: set[str] = set()  # sample ids whose results the store holds (a resumed run)
        self.queue_trace: list[tuple[float, str, int]] = []
        self.recovery = RecoveryPlanner(self)

        # Memos that change no decision, only skip asking again (they make the simulator fast at scale).
        # What can make an agent's waiting request eligible: a new request, a sync, a freed or moved slot, and
        # in layered mode any finished node.
        self.changed = {a: 0 for a in self.agents}
        self.layer_progress = 0
        self._stuck: dict[str, tuple[int, int]] = {}
        self._runnable: dict[str, tuple[tuple[int, int], int]] = {}
        self._balanced: tuple | None = None  # the balancer's inputs when it last said no, and when
        self._balanced_at = 0.0
        self._work_stale: set[str] = set(self.agents)  # agents whose training answer may have changed
        self._work: dict[str, tuple | None] = {}

    # ------------------------------------------------------------------ commands out

    def drain(self) -> Iterator[object]:
        """The commands decided since the last call, oldest first (carrying one out may add more)."""
        while self.outbox:
            yield self.outbox.popleft()

    def _emit(self, command: object) -> None:
        if isinstance(command, Task):
            self.inflight.add(command)
        self.outbox.append(command)

    def touch(self, *agents: str) -> None:
        """Something an agent's decisions read changed outside the usual events (recovery does this)."""
        for agent in agents or self.agents:
            self.changed[agent] += 1
            self._work_stale.add(agent)
        self._stuck.clear()
        self._balanced = None

    # ------------------------------------------------------------------ steps and episodes

    def admissible(self) -> int | None:
        """The next step to open, or None while the policy admits none."""
        step = self.next_step
        if step in self.steps or not (step < self.resume_until or self.policy.admits_step(step, self.versions)):
            return None
        return step

    def open_step(self, step: int, input_ids: list[str]) -> StepState:
        """Admit ``step`` with its queries' input ids: its micro-batches are partitioned (an executor resuming a
        run marks the stored ones with ``restore``); nothing is enqueued until ``start_step``."""
        n = len(input_ids) * self.group_size
        self.steps[step] = StepState(step, list(input_ids), [set() for _ in range(n)], [set() for _ in range(n)],
                                     [0] * len(input_ids))
        for agent in self.agents:
            per_query = self.group_size * len(self.nodes_of[agent])
            batches: dict[int, MicroBatch] = {}
            for q in range(len(input_ids)):
                i = micro_batch_of(q, per_query, self.shape[agent].micro_batch_size)
                batches.setdefault(i, MicroBatch(agent, step, i, set())).queries.add(q)
            self.micro[(agent, step)] = [batches[i] for i in sorted(batches)]
        self.next_step = step + 1
        self._work_stale.update(self.agents)
        return self.steps[step]

    def start_step(self, step: int, replay: set[str] = frozenset()) -> None:
        """Enqueue the step's root nodes; those in ``replay`` come out as ``Replay`` commands instead."""
        self.replay |= set(replay)
        for episode in range(len(self.steps[step].done)):
            for node in self.roots:
                self._enqueue(step, episode, node)

    def sample_id(self, step: int, episode: int, node: str) -> str:
        q, j = divmod(episode, self.group_size)
        return sample_id(self.steps[step].input_ids[q], self.turn[node], j)

    def _enqueue(self, step: int, episode: int, node: str) -> None:
        self.steps[step].queued[episode].add(node)
        request = Request(step, self.sample_id(step, episode, node), episode, node)
        if request.sample_id in self.replay:  # committed before a crash: replayed, not generated again
            self.replay.discard(request.sample_id)
            self.outbox.append(Replay(request))
            return
        agent = self.agent_of[node]
        self.waiting[agent].append(request)
        self.changed[agent] += 1

    def node_done(self, request: Request, skipped: Sequence[str] = ()) -> None:
        """A request's result is recorded; ``skipped``: later loop turns its early stop removed."""
        state = self.steps[request.step]
        done = state.done[request.episode]
        resolved = [request.node, *(n for n in skipped if n not in done)]
        for node in resolved:  # a skipped node counts as done for its layer
            done.add(node)
            state.finished_nodes[self.layer[node]] += 1
        if self.policy.layered:
            self.layer_progress += 1
        if len(done) == len(self.order):
            self._on_episode_done(state, request.episode)
        for node in resolved:
            for child in self.children[node]:
                if child not in done and child not in state.queued[request.episode] and all(
                        p in done for p in self.parents[child]):
                    self._enqueue(request.step, request.episode, child)

    def _on_episode_done(self, state: StepState, episode: int) -> None:
        q = episode // self.group_size
        state.done_in_group[q] += 1
        if state.done_in_group[q] < self.group_size:
            return
        state.done_groups += 1
        self.outbox.append(GroupDone(state.step, q))
        for agent in self.agents:
            batches = self.micro[(agent, state.step)]
            mb = next(m for m in batches if q in m.queries)
            mb.done_queries.add(q)
            if not self.shape[agent].agent_wise:
                if mb.done_queries == mb.queries:
                    self.outbox.append(Commit(agent, state.step, (mb,), False))
            elif all(m.done_queries == m.queries for m in batches):
                # agent-wise normalisation needs the agent's whole batch: commit every micro-batch now
                self.outbox.append(Commit(agent, state.step, tuple(batches), True))
        if state.done_groups == len(state.done_in_group):
            del self.steps[state.step]  # every sample is committed: the episodes need not stay in memory
            self.outbox.append(StepDone(state.step))

    def committed(self, mb: MicroBatch, at: float, data: object = None, *, trainable: bool = True,
                  consumed: bool = False) -> None:
        """``mb`` is in the store (``data``: what its trainer reads). ``trainable`` False: nothing to learn from
        (every episode failed); ``consumed``: a resumed run's agent already trained it."""
        mb.committed, mb.committed_at, mb.data = True, at, data
        mb.trainable = trainable and not consumed
        if not mb.trainable:
            mb.submitted = mb.trained = True
        self._work_stale.add(mb.agent)
        if all(m.committed for m in self.micro[(mb.agent, mb.step)]):
            self.complete[mb.agent].add(mb.step)
            self._work_stale.update(self.agents)  # may_train may read every agent's complete steps (sync does)

    # ------------------------------------------------------------------ rollout

    def dispatch(self, now: float) -> None:
        """Decide new generation batches and training work (into ``drain()``)."""
        self._dispatch_generation(now)
        if self.train:
            self._dispatch_training()

    def _dispatch_generation(self, now: float) -> None:
        self._balance(now)
        for agent, waiting in self.waiting.items():
            if not waiting or self._stuck.get(agent) == (self.changed[agent], self.layer_progress):
                continue
            free = {f"{i}": r for i, r in enumerate(self.replicas[agent]) if not r.busy}
            # the requests a replica may take depend only on its version (and the layers done), so a version
            # with none stays without any until something changes
            nothing_for: set[int] = set()
            shape = self.shape[agent]
            while free and waiting:
                # intra-agent balancing: a free slot on a worker with no other work queued, then the one whose
                # worker has the fewest tokens outstanding
                rep = free.pop(self.policy.pick_replica(
                    {k: (self.inflight.holding(r.worker), self.outstanding_tokens[r.worker]) for k, r in free.items()}))
                if self.inflight.holding(rep.worker) and self._generating_on_a_free_worker(agent):
                    break  # the batch would wait for a training task; a replica that only generates frees first
                version = self.engine_version[(agent, rep.worker)]
                if version in nothing_for:
                    continue
                eligible = self._eligible(agent, waiting, version)
                chosen = self.policy.pick_requests([(waiting[i].step, waiting[i].sample_id) for i in eligible],
                                                   self.policy.batch_limit(shape.batch_limit, shape.micro_batch_size))
                if not chosen:
                    nothing_for.add(version)
                    continue
                items = tuple(waiting[eligible[c]] for c in chosen)
                for c in sorted((eligible[c] for c in chosen), reverse=True):
                    del waiting[c]
                self.changed[agent] += 1  # its queue shrank: what ``runnable`` counted is out of date
                rep.busy = True
                tokens = len(items) * shape.max_new_tokens
                self.outstanding_tokens[rep.worker] += tokens
                self._emit(Generate(agent, rep.worker, rep, items, tokens))
            if waiting and not any(not r.busy and self.engine_version[(agent, r.worker)] not in nothing_for
                                   for r in self.replicas[agent]):
                self._stuck[agent] = (self.changed[agent], self.layer_progress)

    def _generating_on_a_free_worker(self, agent: str) -> bool:
        """Does a replica of ``agent`` generate on a worker with nothing else queued? It takes the next batch
        when it is done, which is sooner than a worker busy training would start it."""
        return any(r.busy and not self.inflight.holding(r.worker) for r in self.replicas[agent])

    def _eligible(self, agent: str, waiting: list[Request], version: int) -> list[int]:
        """Indices of the waiting requests a replica at ``version`` may take; the policy is asked once per
        distinct step and (step, layer), since its answers depend on nothing else."""
        may: dict[int, bool] = {}
        open_: dict[tuple[int, int], bool] = {}
        out = []
        for i, r in enumerate(waiting):
            ok = may.get(r.step)
            if ok is None:
                ok = may[r.step] = self.policy.may_generate(agent, r.step, version)
            if not ok:
                continue
            key = (r.step, self.layer[r.node])
            layer_ok = open_.get(key)
            if layer_ok is None:
                layer_ok = open_[key] = self.policy.layer_open(key[1], self.steps[r.step].finished_nodes, self.needed)
            if layer_ok:
                out.append(i)
        return out

    def runnable(self, agent: str) -> int:
        """The agent's waiting requests that some engine of its could take now: not those waiting for its own
        weight sync or an earlier layer. The balancer weighs these, since moving a slot to requests that no
        version on it may generate helps nobody."""
        key = (self.changed[agent], self.layer_progress)
        cached = self._runnable.get(agent)
        if cached is not None and cached[0] == key:
            return cached[1]
        versions = {self.engine_version[(agent, w)] for w in self.engines[agent] if (agent, w) in self.engine_version}
        count = len({i for v in versions for i in self._eligible(agent, self.waiting[agent], v)})
        self._runnable[agent] = (key, count)
        return count

    def _balance(self, now: float) -> None:
        """Record each agent's queue; inter-agent balancing moves idle replica slots to the longest queues."""
        for agent, waiting in self.waiting.items():
            last = next((d for _, a, d in reversed(self.queue_trace) if a == agent), None)
            if last != len(waiting):
                self.queue_trace.append((now, agent, len(waiting)))
        if self.balancer is None:
            return
        while True:
            queue_depth = {a: self.runnable(a) for a in self.agents}
            slots = {a: len(r) for a, r in self.replicas.items()}
            idle = {a: sum(not x.busy for x in r) for a, r in self.replicas.items()}
            # decide() reads these, where the idle slots are, and the clock only through past moves' cooldowns
            placement = tuple((r.agent, r.worker, r.busy) for reps in self.replicas.values() for r in reps)
            key = (tuple(queue_depth.values()), placement)
            if key == self._balanced and not self.balancer.cooldown_ended_between(self._balanced_at, now):
                return
            move = self.balancer.decide(now, queue_depth, slots, idle, partial(adds_capacity, self.replicas, self.balancer.lanes))
            if move is None:
                self._balanced, self._balanced_at = key, now
                return
            # the target's engine is resident on every rollout worker: the slot switches at once
            move_slot(self.replicas, move, self.outstanding_tokens)
            self.changed[move.target] += 1

    # ------------------------------------------------------------------ events in

    def done(self, task: Task, value: object = None) -> bool:
        """A worker task finished; False if it was given up meanwhile (nothing happens then)."""
        if not self.inflight.pop(task):
            return False
        handler = _HANDLERS.get(task.kind)
        if handler is not None:
            handler(self, task, value)
        else:
            self.recovery.done(task, value)
        return True

    def _on_generated(self, task: Generate, value: object) -> None:
        task.replica.busy = False
        self.outstanding_tokens[task.worker] -= task.tokens
        self.changed[task.agent] += 1  # results are reported one by one with ``node_done``

    def _on_trained(self, task: Train, value: object) -> None:
        task.batch.trained = True
        self.queued[task.agent] -= 1
        self._work_stale.add(task.agent)

    def _on_step_finished(self, task: Finish, value: object) -> None:
        # the agent stays blocked until its replicas have the weights; its slot is free right away
        self.bound[task.agent] = None
        self._work_stale.add(task.agent)
        version = task.step + 1
        if self.snapshot_every and (version % self.snapshot_every == 0 or version == self.policy.steps):
            # copied before the update is recorded; other versions are rebuilt from it by replay when needed. The
            # last is written before the run may end; the others are written while the worker works on
            self._emit(Snapshot(task.agent, self.location[task.agent], task.step,
                                background=version != self.policy.steps))
        else:
            self.outbox.append(RecordUpdate(task.agent, task.step))

    def _on_snapshot(self, task: Snapshot, value: object) -> None:
        self.outbox.append(RecordUpdate(task.agent, task.step))

    def updated(self, agent: str, step: int, version: int) -> list[MicroBatch]:
        """The agent's update of ``step`` is recorded at ``version``: its engines get the new weights. Returns
        the step's micro-batches."""
        batches = self.micro.pop((agent, step))
        self.versions[agent] = version
        for worker in self.engines[agent]:
            self.pending_syncs[agent] += 1
            self._emit(Sync(agent, worker, version, self.location[agent]))
        self.touch(agent)
        return batches

    def _on_synced(self, task: Sync, value: object) -> None:
        self.engine_version[(task.agent, task.worker)] = task.version
        self.pending_syncs[task.agent] -= 1
        if self.pending_syncs[task.agent] == 0 and task.agent not in self.recovery.restores:
            self.blocked[task.agent] = False
        self.touch(task.agent)

    def _on_moved(self, task: Resume, value: object) -> None:
        self.outbox.append(Discard(task.agent, task.source, trainer=True))  # before any later resume there
        self.location[task.agent] = task.worker
        self.blocked[task.agent] = False
        self.parked.discard(task.agent)
        self._work_stale.add(task.agent)

    # ------------------------------------------------------------------ questions

    def is_finished(self, target: int) -> bool:
        return all(v >= target for v in self.versions.values()) or (not self.train and not self.steps)

    def blocking(self, agent: str) -> bool:
        return bool(self.inflight.of(agent, *BLOCKING))


_HANDLERS = {
    TaskKind.GENERATE: Scheduler._on_generated,
    TaskKind.TRAIN: Scheduler._on_trained,
    TaskKind.FINISH: Scheduler._on_step_finished,
    TaskKind.SNAPSHOT: Scheduler._on_snapshot,
    TaskKind.SYNC: Scheduler._on_synced,
    TaskKind.RESUME: Scheduler._on_moved,
    TaskKind.PARK: lambda self, task, value: None,
}

