"""Was every planned prompt trained exactly once per step? Counted from the store against the run's plan.

The plan of a run is deterministic: step s draws ``run.queries_per_step`` tasks from the task stream, and
each agent's batch of s holds one sample per (task, group member, node of the agent). The update of an agent
to version s + 1 consumes that batch. After a crash, a resume or a lost worker, ``training_coverage`` counts
what went wrong, if anything: planned samples no update trained (lost), samples stored or trained more than
once (duplicated), samples an update trained that its step did not plan (unplanned), and planned prompts of
which an agent trained nothing in their step (skipped).

Samples that cannot be trained by design are not counted as lost: nodes a loop's early stop skipped (never
generated), samples of an episode whose reward failed (stored as ``generated``), and, for an agent with
``training.dynamic_sampling``, the samples of groups without signal (stored, never consumed;
``scoring.signal_free_groups``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow.compute as pc

from flexmarl.config import RunConfig
from flexmarl.rollout.episodes import sample_id
from flexmarl.rollout.scoring import trainable_samples
from flexmarl.workloads.datasets import problem_stream
from storage.schema import SampleStatus
from storage.store import EPISODES, UPDATES, ExperienceStore


@dataclass(frozen=True)
class Coverage:
    samples_lost: int
    samples_duplicated: int
    samples_unplanned: int
    prompts_skipped: int
    steps: int  # steps checked (those every agent has updated past)

    @property
    def exact(self) -> bool:
        return not (self.samples_lost or self.samples_duplicated or self.samples_unplanned or self.prompts_skipped)


def training_coverage(store: ExperienceStore, cfg: RunConfig) -> Coverage:
    """Compare what each agent's updates consumed with the run's plan (see the module docstring)."""
    tasks = problem_stream(cfg.data)
    order = {node: turn for turn, node in enumerate(cfg.graph.expanded.order())}
    updates = store.read(UPDATES, columns=["agent", "policy_version", "consumed_ids"])
    episodes = store.read(EPISODES, columns=["episode_id", "node_status"])
    skipped = {  # (episode id, node) a loop's early stop left out
        (eid, node) for eid, status in zip(episodes["episode_id"].to_pylist(), episodes["node_status"].to_pylist(),
                                           strict=True)
        for node, s in status if s == "skipped"
    }
    versions = {a: store.policy_version(a) for a in cfg.agents}
    steps = min(min(versions.values()), cfg.run.steps)
    lost = duplicated = unplanned = prompts_skipped = 0
    for agent in cfg.agents:
        samples = store.read_samples(agent, columns=["sample_id", "status", "input_id", "node", "advantage"])
        ids = samples["sample_id"].to_pylist()
        duplicated += len(ids) - len(set(ids))  # stored twice
        rewarded = samples.filter(pc.field("status") == SampleStatus.REWARDED.value)
        trained, _ = trainable_samples(rewarded, dynamic_sampling=cfg.trainer_config(agent).dynamic_sampling)
        untrainable = set(ids) - set(trained["sample_id"].to_pylist())  # not rewarded, or dropped
        mine = updates.filter(pc.field("agent") == agent)
        consumed_by = dict(zip(mine["policy_version"].to_pylist(), mine["consumed_ids"].to_pylist(), strict=True))
        counts = Counter(sid for consumed in consumed_by.values() for sid in consumed)
        duplicated += sum(n - 1 for n in counts.values() if n > 1)  # trained twice
        for step in range(steps):
            consumed = set(consumed_by.get(step + 1, []))
            planned_ids = set()
            for task in tasks.batch(step, cfg.run.queries_per_step):
                expected = {
                    sample_id(task.input_id, order[node], j)
                    for j in range(cfg.run.group_size) for node in cfg.nodes_of(agent)
                    if (f"{task.input_id}_{j}", node) not in skipped
                }
                planned_ids |= expected
                expected -= untrainable
                lost += len(expected - consumed)
                if expected and not expected & consumed:
                    prompts_skipped += 1
            unplanned += len(consumed - planned_ids)
    return Coverage(lost, duplicated, unplanned, prompts_skipped, steps)
