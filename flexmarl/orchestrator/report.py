"""The run report (``RUN_DIR/report.json``), built from the store so that it cannot disagree with it."""

from __future__ import annotations

from collections import defaultdict

import pyarrow.compute as pc

from flexmarl.config import RunConfig
from flexmarl.orchestrator.runtime import RolloutSummary, RunContext, UpdateSummary
from storage.store import UPDATES, ExperienceStore


def build_report(
    ctx: RunContext,
    cfg: RunConfig,
    rollouts: list[RolloutSummary],
    updates: list[UpdateSummary],
    *,
    wall_s: float,
) -> dict:
    store = ExperienceStore(ctx.store_uri, storage_options=cfg.store.storage_options or None)
    update_rows = store.read(UPDATES)
    agents = {}
    for agent in cfg.agents:
        samples = store.read_samples(agent, columns=["step", "reward", "response_ids"])
        mine = update_rows.filter(pc.field("agent") == agent)
        by_step: dict[int, list[float]] = defaultdict(list)
        for step, reward in zip(samples["step"].to_pylist(), samples["reward"].to_pylist(), strict=True):
            if reward is not None:
                by_step[step].append(reward)
        agents[agent] = {
            "policy_version": store.policy_version(agent),
            "updates": mine.num_rows,
            "samples_generated": samples.num_rows,
            "samples_trained": sum(len(ids) for ids in mine["consumed_ids"].to_pylist()),
            "tokens_generated": int(pc.sum(pc.list_value_length(samples["response_ids"])).as_py() or 0),
            # None for a step without rewarded samples (every episode failed)
            "mean_reward": [sum(by_step[r.step]) / len(by_step[r.step]) if by_step[r.step] else None
                            for r in rollouts],
            "update_s": [u.train_s for u in updates if u.agent == agent],
            "sync_s": [u.sync_s for u in updates if u.agent == agent],
        }
    return {
        "run_id": ctx.run_id,
        "mode": cfg.train.mode,
        "wall_s": wall_s,
        "run_dir": ctx.run_dir,
        "store_uri": ctx.store_uri,
        "steps": [
            {"step": r.step, "rollout_s": r.wall_s, "store_s": r.store_s
             + sum(u.store_s for u in updates if u.step == r.step), "tokens_per_s": r.tokens_per_s,
             "failed_episodes": r.failed_episodes, "unparsed": r.unparsed}
            for r in rollouts
        ],
        "agents": agents,
    }
