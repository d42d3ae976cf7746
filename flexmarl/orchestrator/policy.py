"""Scheduling decisions as plain objects: state in, decision out; no Dask, Prefect or Delta inside.

The pipeline runtime (``pipeline.py``) asks these questions whenever something happens (a sample batch
finished, a micro-batch was committed, an update finished); a simulator can ask the same questions with a
simulated clock.

The modes differ only in the answers:
- ``sync`` (the MARTI-like baseline): a step's rollout starts when every agent is at that step's version;
  the graph is sampled layer by layer; training starts when the whole step is generated for every agent.
- ``flexmarl``: each agent runs on its own clock; a node is sampled as soon as its parents are done and its
  agent's replica holds an admissible version; a committed micro-batch is trained at once (``pipeline``),
  while rollout goes on with the same weights; one optimizer step per global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulePolicy:
    mode: str  # "sync" or "flexmarl"
    steps: int
    pipeline: bool  # train micro-batches while the rest of the batch is generated
    max_staleness: dict[str, int]  # per agent: how many versions behind a sample's generator may be

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

    def may_train(self, agent: str, step: int, complete: dict[str, set[int]]) -> bool:
        """May a committed micro-batch of ``agent``'s ``step`` be trained now?

        ``complete[a]`` holds the steps whose whole batch agent ``a`` has committed.
        """
        if self.mode == "sync":  # barrier: every agent's whole batch first
            return all(step in done for done in complete.values())
        return self.pipeline or step in complete[agent]

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
    def pick_replica(outstanding_tokens: dict[str, int]) -> str:
        """Intra-agent balancing: the replica with the fewest outstanding tokens (ties: by name)."""
        return min(sorted(outstanding_tokens), key=outstanding_tokens.__getitem__)


def micro_batch_of(query_index: int, samples_per_query: int, micro_batch_size: int) -> int:
    """Micro-batches are whole GRPO groups of consecutive queries: the same partition in every mode."""
    queries_per_micro = max(1, micro_batch_size // max(samples_per_query, 1))
    return query_index // queries_per_micro
