"""The pipeline's scheduling core: events in, typed commands out; no Dask, no clock, no I/O.

A ``Scheduler`` holds the admitted steps and their episodes' progress through the MEG, and its state in three
explicit parts, each with named operations: ``rollout`` (``RolloutQueues``: waiting requests, replicas, engines
and the inter-agent balancer), ``training`` (``TrainingBindings``: versions, micro-batches, trainers' homes and
slot bindings) and ``inflight`` (the ``InFlight`` ledger of jobs). What a lost worker's work becomes is
``recovery`` (``RecoveryPlanner``), on the same parts. Every decision is asked of ``SchedulePolicy``,
``micro_batch_of`` and ``InterAgentBalancer``. Two executors drive it: the Dask runtime (``pipeline.py``) and
the simulated clock (``flexmarl/sim/engine.py``); they carry the commands out (``commands.py``) and report what
happened, and neither decides anything the other does not.

An executor's turn: ``admissible()`` / ``open_step`` / ``start_step`` for each new step, ``dispatch(now)``,
then one event (``done``, ``node_done``, ``committed``, ``updated``); after each, it carries out ``drain()``.
``now`` is the executor's clock, in seconds: the balancer's cooldowns and the queue trace read it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from flexmarl.meg.graph import ExpandedGraph, sample_id
from flexmarl.orchestrator.commands import (
    Finish, Generate, GroupDone, InFlight, Job, JobKind, Join, MicroBatch, MoveState, Replay, Request, Snapshot,
    StepDone, StoredBatch, Sync, Train,
)
from flexmarl.orchestrator.policy import AgentShape, SchedulePolicy, micro_batch_of
from flexmarl.orchestrator.recovery import RecoveryPlanner
from flexmarl.orchestrator.rollout_queues import RolloutQueues
from flexmarl.orchestrator.training_bindings import TrainingBindings
from flexmarl.rollout.balancer import InterAgentBalancer


@dataclass
class StepState:
    step: int
    input_ids: list[str]
    done: list[set[str]]  # per episode: its nodes done or skipped
    queued: list[set[str]]  # per episode: its nodes enqueued so far
    done_in_group: list[int]  # per query: finished episodes
    done_groups: int = 0
    finished_nodes: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # layer -> count


class Scheduler:
    """See the module docstring.

    Args:
        policy: the schedule's decisions.
        graph: the expanded MEG (copies and loops unrolled).
        agents: per agent, its shape.
        queries_per_step, group_size: the global batch.
        replicas: the rollout replicas as (worker, agent it serves first).
        engines: per agent, the workers holding its rollout engine (each gets the agent's weight syncs).
        slots: the training workers; agents bind them on demand.
        location: per agent, the worker holding its trainer.
        versions: per agent, the starting policy version.
        balancer: inter-agent balancing, or None.
        train: False samples and commits the steps without training (the rollout benchmark).
        snapshot_every: write an agent's training state after every k-th update (versions k, 2k, ... and the
            last), before it is recorded; 0: never.
        memo: keep the memos that skip asking again what cannot have changed (``rollout_queues.py``); False
            asks afresh every time, for the test that they change no decision.
    """

    def __init__(self, *, policy: SchedulePolicy, graph: ExpandedGraph, agents: dict[str, AgentShape],
                 queries_per_step: int, group_size: int, replicas: Sequence[tuple[str, str]],
                 engines: dict[str, list[str]], slots: Sequence[str], location: dict[str, str],
                 versions: dict[str, int], balancer: InterAgentBalancer | None = None, train: bool = True,
                 snapshot_every: int = 0, memo: bool = True) -> None:
        self.policy, self.graph, self.shape = policy, graph, agents
        self.agents = list(agents)
        self.queries_per_step, self.group_size, self.train = queries_per_step, group_size, train
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
        needed = {k: queries_per_step * group_size * c for k, c in per_layer.items()}

        self.steps: dict[int, StepState] = {}
        self.next_step = min(versions.values())
        self.resume_until = max(versions.values())  # steps some agent has trained: admitted in any mode
        self.replay: set[str] = set()  # sample ids whose results the store holds (a resumed run)
        self.inflight = InFlight()
        self.outbox: deque = deque()
        self.rollout = RolloutQueues(
            agents=self.agents, shapes=agents, policy=policy, layer=self.layer, needed=needed,
            finished_nodes=lambda step: self.steps[step].finished_nodes, replicas=replicas, engines=engines,
            versions=versions, balancer=balancer, inflight=self.inflight, emit=self._emit, memo=memo)
        self.training = TrainingBindings(
            agents=self.agents, policy=policy, slots=slots, location=location, versions=versions,
            agent_wise={a for a, shape in agents.items() if shape.agent_wise}, inflight=self.inflight,
            emit=self._emit, snapshot_every=snapshot_every, memo=memo,
            max_slots={a: shape.max_slots for a, shape in agents.items()},
            sharded={a for a, shape in agents.items() if shape.sharded})
        self.recovery = RecoveryPlanner(agents=self.agents, rollout=self.rollout, training=self.training,
                                        inflight=self.inflight, emit=self._emit, touch=self.touch,
                                        balanced=balancer is not None)

    @property
    def versions(self) -> dict[str, int]:
        """Each agent's policy version: the schedule's clock."""
        return self.training.versions

    # ------------------------------------------------------------------ commands out

    def drain(self) -> Iterator[object]:
        """The commands decided since the last call, oldest first (carrying one out may add more)."""
        while self.outbox:
            yield self.outbox.popleft()

    def _emit(self, command: object) -> None:
        if isinstance(command, Job):
            self.inflight.add(command)
        self.outbox.append(command)

    def touch(self, *agents: str) -> None:
        """Something an agent's decisions read changed outside the usual events (recovery does this)."""
        agents = agents or tuple(self.agents)
        self.rollout.touch(agents)
        self.training.touch(agents)

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
        partition = {}
        for agent in self.agents:
            per_query = self.group_size * len(self.nodes_of[agent])
            batches: dict[int, MicroBatch] = {}
            for q in range(len(input_ids)):
                i = micro_batch_of(q, per_query, self.shape[agent].micro_batch_size)
                batches.setdefault(i, MicroBatch(agent, step, i, set())).queries.add(q)
            partition[agent] = [batches[i] for i in sorted(batches)]
        self.training.add_step(step, partition)
        self.next_step = step + 1
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
            self._emit(Replay(request))
            return
        self.rollout.enqueue(self.agent_of[node], request)

    def node_done(self, request: Request, skipped: Sequence[str] = ()) -> None:
        """A request's result is recorded; ``skipped``: later loop turns its early stop removed."""
        state = self.steps[request.step]
        done = state.done[request.episode]
        resolved = [request.node, *(n for n in skipped if n not in done)]
        for node in resolved:  # a skipped node counts as done for its layer
            done.add(node)
            state.finished_nodes[self.layer[node]] += 1
        self.rollout.node_finished()
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
        self._emit(GroupDone(state.step, q))
        self.training.group_done(state.step, q)
        if state.done_groups == len(state.done_in_group):
            del self.steps[state.step]  # every sample is committed: the episodes need not stay in memory
            self._emit(StepDone(state.step))

    def committed(self, mb: MicroBatch, at: float, stored: StoredBatch | None = None, *, trainable: bool = True,
                  consumed: bool = False) -> None:
        """``mb`` is in the store (``stored``: where its trainer reads it). ``trainable`` False: nothing to learn
        from (every episode failed); ``consumed``: a resumed run's agent already trained it."""
        self.training.committed(mb, at, stored, trainable=trainable, consumed=consumed)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, now: float) -> None:
        """Decide new generation batches and training work (into ``drain()``)."""
        self.rollout.dispatch(now)
        if self.train:
            self.training.dispatch()

    # ------------------------------------------------------------------ events in

    def done(self, job: Job, value: object = None, seconds: float | None = None) -> bool:
        """A job finished, after ``seconds`` on its worker (the growth rule's prices); False if it was given up
        meanwhile (nothing happens then)."""
        if not self.inflight.pop(job):
            return False
        if seconds is not None:
            self.training.prices.observe(job, seconds)
        if isinstance(job, Generate):
            self.rollout.generated(job)
        elif isinstance(job, Train):
            self.training.trained(job)
        elif isinstance(job, Finish):
            self.training.step_finished(job)
        elif isinstance(job, Snapshot):
            self.training.snapshot_written(job)
        elif isinstance(job, Sync):
            self.rollout.synced(job.agent, job.worker, job.version)
            self.training.synced(job.agent, restoring=job.agent in self.recovery.restores)
            self.rollout.touch([job.agent])
        elif isinstance(job, MoveState):
            self.training.state_moved(job)
        elif isinstance(job, Join):
            self.training.joined(job)
        elif job.kind is not JobKind.PARK:
            self.recovery.done(job, value)
        return True

    def updated(self, agent: str, step: int, version: int) -> list[MicroBatch]:
        """The agent's update of ``step`` is recorded at ``version``: its engines get the new weights. Returns
        the step's micro-batches."""
        engines = list(self.rollout.engines[agent])
        batches = self.training.updated(agent, step, version, syncs=len(engines))
        for worker in engines:
            self._emit(Sync(agent, worker, version, self.training.location[agent]))
        self.rollout.touch([agent])
        return batches

    # ------------------------------------------------------------------ questions

    def is_finished(self, target: int) -> bool:
        return self.training.is_finished(target) or (not self.train and not self.steps)


