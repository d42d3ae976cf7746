"""The run report (``RUN_DIR/report.json``): counts from the store, timings from the pipeline."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import pyarrow.compute as pc

from flexmarl.config import RunConfig
from flexmarl.orchestrator.records import PipelineResult, WeightSynced
from flexmarl.orchestrator.runtime import RunContext
from storage.store import EPISODES, UPDATES, ExperienceStore


def weight_sync_costs(syncs: list[WeightSynced], agents: Iterable[str]) -> dict[str, dict]:
    """Each agent's weight syncs: how many replica loads (and how many of them in place: from a trainer on the
    replica's worker, no copy through host memory), and per update (a version its replicas took) the bytes sent
    and the seconds the replicas spent taking them, summed over its replicas."""
    costs = {}
    for agent in agents:
        mine = [s for s in syncs if s.agent == agent]
        updates = max(len({s.version for s in mine if s.nbytes > 0}), 1)
        costs[agent] = {"replica_syncs": len(mine), "in_place_syncs": sum(s.in_place for s in mine),
                        "bytes_per_update": sum(s.nbytes for s in mine) / updates,
                        "seconds_per_update": sum(s.seconds for s in mine if s.nbytes > 0) / updates}
    return costs


def build_report(ctx: RunContext, cfg: RunConfig, result: PipelineResult, *, wall_s: float) -> dict:
    """Per-agent counts read back from the store (so the report cannot disagree with it), plus timings."""
    store = ExperienceStore.from_config(ctx.store_uri, cfg.store)
    update_rows = store.read(UPDATES)
    busy: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    worker_busy: dict[str, float] = defaultdict(float)
    for span in result.spans:
        busy[span.agent][span.kind] += span.end - span.start
        if not span.background:  # a prefetch read overlaps the worker's tasks
            worker_busy[span.worker] += span.end - span.start
    agents = {}
    sync_costs = weight_sync_costs(result.syncs, cfg.agents)
    for agent in cfg.agents:
        samples = store.read_samples(agent, columns=["step", "reward", "response_ids", "parsed"])
        mine = update_rows.filter(pc.field("agent") == agent)
        by_step: dict[int, list[float]] = defaultdict(list)
        for step, reward in zip(samples["step"].to_pylist(), samples["reward"].to_pylist(), strict=True):
            if reward is not None:
                by_step[step].append(reward)
        events = sorted((u for u in result.updates if u.agent == agent), key=lambda u: u.step)
        steps = sorted(set(by_step) | {u.step for u in events})
        agents[agent] = {
            "policy_version": store.policy_version(agent),
            "updates": mine.num_rows,
            "samples_generated": samples.num_rows,
            "samples_trained": sum(len(ids) for ids in mine["consumed_ids"].to_pylist()),
            # outputs the agent's parser could not read (the built-in rewards give them 0)
            "samples_unparsed": samples["parsed"].null_count,
            "tokens_generated": int(pc.sum(pc.list_value_length(samples["response_ids"])).as_py() or 0),
            # None for a step without rewarded samples (every episode failed)
            "mean_reward": [sum(by_step[s]) / len(by_step[s]) if by_step[s] else None for s in steps],
            "update_finished_s": [u.finished_at for u in events],
            "skipped_updates": sum(u.skipped for u in events),
            "busy_s": dict(busy[agent]),
            "weight_sync": sync_costs[agent],
        }
    outcomes = store.read(EPISODES, columns=["outcome"])["outcome"]
    return {
        "run_id": ctx.run_id,
        # episodes whose reward function raised: recorded, not trained on, and the run went on
        "episodes_failed": int(pc.sum(pc.equal(outcomes, "failed")).as_py() or 0),
        "mode": cfg.run.mode,
        "wall_s": wall_s,
        "pipeline_s": result.wall_s,
        "utilization": result.utilization(),
        # the driver loop's busy share: near 1, the driver (scoring, commits, dispatch) limits the pipeline
        "driver_busy_share": result.driver_busy_share(),
        "driver_busy_by_step": {str(step): share for step, share in result.driver_busy_by_step().items()},
        "workers": len(result.workers),
        # busy fraction of each worker (rollout replicas and training slots alike)
        "worker_utilization": {w: worker_busy[w] / result.wall_s if result.wall_s > 0 else 0.0
                               for w in result.workers},
        "tokens_per_s": result.tokens / result.wall_s if result.wall_s > 0 else 0.0,
        # the store's cost: driver commits (which delay dispatch) and trainers' reads (inside training time)
        "store_write_s": result.store_write_s,
        "store_read_s": result.store_read_s,
        "run_dir": ctx.run_dir,
        "store_uri": ctx.store_uri,
        # this attempt: node outputs generated, and those replayed from the store (a resumed run)
        "samples_generated": result.samples_generated,
        "samples_reused": result.samples_reused,
        "recoveries": [
            {"workers": list(r.workers), "cause": r.cause,
             "recovered_s": None if r.recovered_at is None else r.recovered_at - r.detected_at}
            for r in result.recoveries
        ],
        "agents": agents,
    }
