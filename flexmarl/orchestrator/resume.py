"""What a run takes over from its store: the samples already committed of steps that are not trained yet.

A run that crashed or was stopped leaves committed micro-batches whose update never happened. The pipeline
that continues it (``flexmarl train --resume``, a Prefect retry) uses them as they are: their results are
replayed into the episodes instead of being generated again, their micro-batches count as committed, and only
the nodes that never reached the store are generated. Per-request seeds make those identical to what the lost
run would have generated, so an episode cut off mid-graph is finished, never trained half, and with staleness
0 the weights come out as those of an uninterrupted run.

Each agent's committed rows of a step come from its own commits; an agent that already trained the step (its
version is past it) has them all in the store, and they are still replayed: other agents' nodes read them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from flexmarl.rollout.backend import GenerationResult
from storage.store import EPISODES, ExperienceStore

COLUMNS = ["sample_id", "input_id", "node", "step", "policy_version", "prompt_ids", "response_ids", "logprobs",
           "finish_reason", "status", "reward"]


@dataclass(frozen=True)
class StoredResult:
    """A node's committed generation, as the rollout engine returned it."""

    prompt_ids: list[int]
    result: GenerationResult


@dataclass(frozen=True)
class StoredStep:
    """One agent's committed rows of one step, and the Delta version they were read at."""

    version: int
    rows: pa.Table  # sample_id, input_id, node, policy_version, status, reward

    def of_inputs(self, input_ids: Iterable[str]) -> pa.Table:
        return self.rows.filter(pc.field("input_id").isin(pa.array(list(input_ids), pa.string())))


class StoredRollout:
    """The store's committed samples of the steps from ``from_step`` on, handed out one step at a time.

    Args:
        store: the run's store.
        agents: the run's agents.
        from_step: the lowest step a resumed run admits (its agents' lowest version); earlier steps are trained.
    """

    def __init__(self, store: ExperienceStore, agents: Iterable[str], from_step: int) -> None:
        self.store = store
        self.steps: dict[str, set[int]] = {}
        for agent in agents:
            steps = store.read(store.samples_table(agent), columns=["step"], filter=pc.field("step") >= from_step)
            self.steps[agent] = set(pc.unique(steps["step"]).to_pylist()) if steps.num_rows else set()
        episodes = store.read(EPISODES, columns=["step"])
        # the episodes of a step are committed in one append: a step listed here must not be appended again
        self.episode_steps: set[int] = set(pc.unique(episodes["step"]).to_pylist()) if episodes.num_rows else set()

    def __bool__(self) -> bool:
        return any(self.steps.values())

    def take(self, step: int) -> tuple[dict[str, StoredResult], dict[str, StoredStep]]:
        """The committed results of ``step`` by sample id, and each agent's committed rows of it.

        A step is handed out once: the pipeline admits each step once.
        """
        results: dict[str, StoredResult] = {}
        committed: dict[str, StoredStep] = {}
        for agent, steps in self.steps.items():
            if step not in steps:
                continue
            steps.discard(step)
            table = self.store.samples_table(agent)
            dt = self.store.open(table)
            rows = self.store.dataset(table, dt=dt, prune=[("step", "=", step)]).to_table(
                columns=COLUMNS, filter=pc.field("step") == step
            )
            for r in rows.select(["sample_id", "prompt_ids", "response_ids", "logprobs", "finish_reason",
                                  "policy_version"]).to_pylist():
                results[r["sample_id"]] = StoredResult(r["prompt_ids"], GenerationResult(
                    r["sample_id"], r["response_ids"], r["logprobs"], r["finish_reason"], r["policy_version"],
                ))
            committed[agent] = StoredStep(
                dt.version(), rows.select(["sample_id", "input_id", "node", "policy_version", "status", "reward"])
            )
        return results, committed
