"""Scheduling decisions as plain objects: state in, decision out; no Dask, Prefect or Delta inside.

The scheduler (``scheduler.py``) asks these questions whenever something happens (a sample batch
finished, a micro-batch was committed, an update finished), for the Dask runtime and the simulator alike.

The modes differ only in the answers:
- ``sync`` (the MARTI-like baseline): a step's rollout starts when every agent is at that step's version;
  the graph is sampled layer by layer; training starts when the whole step is generated for every agent.
- ``flexmarl``: each agent runs on its own clock; a node is sampled as soon as its parents are done and its
  agent's replica holds an admissible version; a committed micro-batch is trained at once (``pipeline``),
  while rollout goes on with the same weights; one optimizer step per global batch.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from flexmarl.orchestrator.config import TrainMode

# Job priorities on a worker are part of the commands' vocabulary: ``commands.JobKind``.


@dataclass(frozen=True)
class AgentShape:
    """What the scheduler needs to know of one agent."""

    micro_batch_size: int  # samples per micro-batch (rounded to whole groups by ``micro_batch_of``)
    max_new_tokens: int  # the most one request generates
    batch_limit: int  # most requests in one generation batch
    agent_wise: bool = False  # ``advantage: agent``: the whole batch is normalised (and committed) together
    max_slots: int = 1  # ``training.max_slots``: the most training slots its trainer group may span
    sharded: bool = False  # ``training.sharding`` not 'none': its trainer spans ``sharded_ranks`` for the whole run


@dataclass(frozen=True)
class GrowthPrice:
    """What one more rank of an agent's trainer group would cost and save, in seconds, as the scheduler has seen
    such jobs take (``prices.JobPrices``)."""

    micro_batch_s: float  # one micro-batch trained on one rank
    park_s: float  # the home's park of the state for the new rank, instead of training (0: parked, or no join)
    join_s: float  # until the new rank may train: the park and its resume (0: the slot holds a copy)
    reduce_s: float  # what the larger group adds to the optimizer step's all-reduce
    displaced_s: float  # moving the agents whose home the slot is and that train this step (inf: not priced yet)


class TrainingDue(Enum):
    """What an agent's trainer should do next for its step."""

    MICRO_BATCH = "micro-batch"  # train its oldest committed, unsubmitted micro-batch
    OPTIMIZER_STEP = "optimizer step"  # the whole batch is committed and trained: end the update


@dataclass(frozen=True)
class SchedulePolicy:
    mode: TrainMode
    steps: int
    pipeline: bool  # train micro-batches while the rest of the batch is generated
    max_staleness: dict[str, int]  # per agent: how many versions behind a sample's generator may be
    queue_depth: int = 2  # micro-batches of one agent queued at once on its slot (a group's ranks: one each)
    grow_at: int = 2  # micro-batches not yet sent, per slot the group holds, for it to copy its state to one more
    micro_batch_generation: bool = False  # pipelined: generation batches of one micro-batch (``batch_limit``)

    @property
    def layered(self) -> bool:
        return self.mode == "sync"

    def admits_step(self, step: int, versions: dict[str, int]) -> bool:
        """May the episodes of ``step`` start?"""
        if step >= self.steps:
            return False
        if self.mode == "sync":
            return all(v == step for v in versions.values())
        return any(self.may_generate(agent, step, v) for agent, v in versions.items())

    def may_generate(self, agent: str, step: int, version: int) -> bool:
        """May weights at ``version`` generate ``agent``'s samples of ``step``?

        The update to ``step + 1`` consumes them, so their generator may lag by at most the staleness bound;
        it can never be ahead, since that update needs them.
        """
        return step - self.max_staleness[agent] <= version <= step

    def batch_limit(self, limit: int, micro_batch_size: int) -> int:
        """Most requests of one agent in one generation batch (``limit``: ``rollout.max_batch_size``).

        With ``micro_batch_generation``, pipelined training cuts generation into micro-batch-sized batches: the
        first micro-batch is then committed, and trained, while the rest of the step is still generated, and
        every replica of the agent gets a share of the step. That pays where a batch's time grows with its
        size (a CPU); where decoding is memory-bound (a GPU), small batches waste the device, and the
        simulator's presets leave it off. The other schedules train on whole batches only.
        """
        cut = self.micro_batch_generation and self.mode == "flexmarl" and self.pipeline
        return min(limit, micro_batch_size) if cut else limit

    def may_train(self, agent: str, step: int, complete: dict[str, set[int]]) -> bool:
        """May a committed micro-batch of ``agent``'s ``step`` be trained now?

        ``complete[a]`` holds the steps whose whole batch agent ``a`` has committed.
        """
        if self.mode == "sync":  # barrier: every agent's whole batch first
            return all(step in done for done in complete.values())
        return self.pipeline or step in complete[agent]

    def layer_open(self, layer: int, finished: Mapping[int, int], needed: Mapping[int, int]) -> bool:
        """May a node of graph layer ``layer`` start? Layered (sync) rollout: every earlier layer is done.

        ``finished[k]`` counts the step's finished (or skipped) nodes of layer ``k`` over all its episodes;
        ``needed[k]`` is how many there are.
        """
        return not self.layered or all(finished.get(k, 0) == needed[k] for k in range(layer))

    def training_due(
        self, agent: str, step: int, complete: dict[str, set[int]], *, ready: bool, queued: int, all_trained: bool,
        ranks: int = 1,
    ) -> TrainingDue | None:
        """What ``agent``'s trainer should do next for ``step``, or nothing (None).

        A micro-batch: its oldest committed, unsubmitted one (``ready``), while the least queued of its ``ranks``
        slots holds (``queued``) fewer than: on one slot ``queue_depth``, so the slot never idles while the driver
        turns one around; in a group one, since the step ends with its last rank, and a micro-batch queued
        behind a busy rank while another idles would hold it back (a turnaround is milliseconds, a micro-batch
        seconds). Gradients sum in float64, so their order (and rank) does not matter. The optimizer step: once
        the agent's whole batch is committed and trained (``all_trained``).
        """
        depth = self.queue_depth if ranks <= 1 else 1
        if ready and queued < depth and self.may_train(agent, step, complete):
            return TrainingDue.MICRO_BATCH
        if step in complete[agent] and all_trained:
            return TrainingDue.OPTIMIZER_STEP
        return None

    def training_work(self, agent: str, step: int, batches: Sequence, complete: dict[str, set[int]], *,
                      queued: int, ranks: int = 1) -> tuple[float, object | None] | None:
        """(ready since, micro-batch to train or None for the optimizer step), or None when nothing is due.

        ``batches`` are the agent's micro-batches of ``step`` (with ``committed``, ``submitted``, ``trained``
        and ``committed_at``); oldest ready data first.
        """
        ready = [m for m in batches if m.committed and not m.submitted]
        due = self.training_due(agent, step, complete, ready=bool(ready), queued=queued,
                                all_trained=all(m.trained for m in batches), ranks=ranks)
        if due is TrainingDue.MICRO_BATCH:
            return ready[0].committed_at, ready[0]
        if due is TrainingDue.OPTIMIZER_STEP:
            return max(m.committed_at for m in batches), None
        return None

    def grows(self, unsent: int, ranks: int, max_slots: int, *, copy_held: bool = False,
              price: GrowthPrice | None = None) -> bool:
        """May an agent whose trainer group holds ``ranks`` slots take an idle one more for its current step?

        Priced (``price``, from the jobs seen so far): where the step's micro-batches not yet sent to a rank
        (``unsent``, committed or not) end sooner on one rank more, by more than the larger all-reduce and the
        moves of the agents the slot is home to cost. Micro-batches are whole (``training_ends``): the new rank
        starts once the home has parked the state (the home trains nothing meanwhile) and the rank has resumed it,
        at once where the slot holds a copy at the agent's version; the group's step ends with its last rank.

        Unpriced (a cost of the agent's own not seen yet): by count, as a first guess that lets the costs be
        seen: ``grow_at`` micro-batches per slot it would then hold where the new rank must first copy the
        state, one where the slot holds a copy (``copy_held``: it trained the agent's last step).

        The group keeps its slots until the step's optimizer step (its gradient sum cannot be handed over
        sooner) and shrinks at the step's end: its slots are free again, and agents waiting for one bind first.
        """
        if ranks >= max_slots:
            return False
        if price is None:
            return unsent >= (1 if copy_held else self.grow_at) * ranks
        now = training_ends(unsent, price.micro_batch_s, [0.0] * ranks)
        grown = training_ends(unsent, price.micro_batch_s, [price.park_s] + [0.0] * (ranks - 1) + [price.join_s])
        return now - grown > price.reduce_s + price.displaced_s

    @staticmethod
    def pick_slot(free: Sequence[str], *preferred: str | None) -> str:
        """The training slot an agent binds: the first of ``preferred`` that is free (where its state was read
        ahead, where it lives), else the first free one."""
        return next((p for p in preferred if p in free), free[0])

    @staticmethod
    def pick_requests(waiting: Sequence[tuple[int, str]], limit: int) -> list[int]:
        """Indices of the waiting requests (step, request id) for one batch: oldest step first."""
        order = sorted(range(len(waiting)), key=lambda i: waiting[i])
        return order[:limit]

    @staticmethod
    def pick_agent(ready_since: dict[str, float]) -> str:
        """A free training slot serves the agent whose ready work has waited longest (ties: by name)."""
        return min(sorted(ready_since), key=ready_since.__getitem__)

    @staticmethod
    def pick_replica(load: dict[str, tuple[int, int]]) -> str:
        """Intra-agent balancing: the replica whose worker has the least (other tasks queued, tokens of
        generation outstanding); ties by name. A Dask worker runs one task at a time, so a batch sent to a
        worker that trains waits for the training."""
        return min(sorted(load), key=load.__getitem__)


def training_ends(micro_batches: int, seconds: float, free_at: Sequence[float]) -> float:
    """When ``micro_batches`` of ``seconds`` each end on ranks free at ``free_at`` (seconds from now), each sent to
    the rank that frees first, whole: the step's training ends with its last rank."""
    ranks, end = list(free_at), 0.0
    heapq.heapify(ranks)
    for _ in range(micro_batches):
        done = heapq.heappop(ranks) + seconds
        heapq.heappush(ranks, done)
        end = max(end, done)
    return end


def sharded_ranks(slots: Sequence[str], max_slots: int) -> tuple[str, ...]:
    """The training slots a sharded agent's trainer spans for the whole run, its home first: the first
    ``max_slots`` in sorted order (so the driver's placement and its scheduler agree).

    Raises:
        ValueError: fewer slots than ``max_slots`` (``runtime.training_slots`` refuses such a cluster first).
    """
    if len(slots) < max_slots:
        raise ValueError(f"{len(slots)} slot(s) for a trainer sharded over {max_slots}")
    return tuple(sorted(slots)[:max_slots])


def micro_batch_of(query_index: int, samples_per_query: int, micro_batch_size: int) -> int:
    """Micro-batches are whole GRPO groups of consecutive queries: the same partition in every mode."""
    queries_per_micro = max(1, micro_batch_size // max(samples_per_query, 1))
    return query_index // queries_per_micro


def deal_replicas(agents: list[str], workers: list[str], per_worker: int) -> list[tuple[str, str]]:
    """Rollout replicas as (worker, agent): replica i of every worker before replica i + 1, agents dealt in turn.

    Every agent gets at least one replica, so a worker may hold more than ``per_worker`` when agents outnumber
    the places.
    """
    places = [w for _ in range(per_worker) for w in workers]
    while len(places) < len(agents):
        places += workers
    return [(w, agents[i % len(agents)]) for i, w in enumerate(places)]
