"""The training flow: one FlexMARL run, as a Prefect flow.

Start it with ``flexmarl train``, from a deployment (``prefect deployment run 'flexmarl-train/tiny'``) or
from the Prefect UI. The flow only orchestrates: each task makes one coarse engine call; generation
batches and micro-batches run on Dask inside the engines.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger

from flexmarl.cluster.local import open_cluster
from flexmarl.config import RunConfig, dump_config, load_config
from flexmarl.orchestrator.runtime import RunContext, Runtime, UpdateSummary, prepare_run
from tasks.engines import save_checkpoint, start_engines
from tasks.publish import publish_report, set_progress, start_progress
from tasks.rollout import rollout_step
from tasks.update import update_agent


def resolve_config(
    config: str | None, preset: str | None, overrides: list[str] | None, steps: int | None, dask_address: str | None
) -> RunConfig:
    extra = list(overrides or [])
    if steps is not None:
        extra.append(f"train.steps={steps}")
    if dask_address:
        extra.append(f"cluster.address={dask_address}")
    return load_config(config, preset=None if config else (preset or "default"), overrides=extra)


@flow(name="flexmarl-train", log_prints=True)
def train_run(
    preset: Literal["default", "tiny"] | None = None,
    config: str | None = None,
    steps: int | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    dask_address: str | None = None,
) -> dict:
    """Train every agent of a MEG with GRPO.

    Args:
        preset: a shipped config, 'default' (SmolLM2-135M solver -> verifier on GSM-style problems) or
            'tiny' (a tiny model, for tests); used when ``config`` is not given.
        config: path of a config YAML file (instead of a preset).
        steps: optimizer steps per agent (overrides ``train.steps``).
        overrides: ``dotted.key=value`` settings, e.g. ``["training.lr=1e-5"]``.
        run_dir: where the store, checkpoints and report go (default ``runs/<time>``).
        dask_address: an existing Dask scheduler; default starts a LocalCluster.

    Returns:
        The run report (also written to ``RUN_DIR/report.json``).
    """
    logger = get_run_logger()
    t0 = time.perf_counter()
    cfg = resolve_config(config, preset, overrides, steps, dask_address)
    run_dir = run_dir or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_id, store_uri = prepare_run(cfg, run_dir)
    logger.info("run %s in %s; resolved config:\n%s", run_id, Path(run_dir).resolve(), dump_config(cfg))

    with open_cluster(cfg.cluster) as address:
        ctx = RunContext(run_id, str(Path(run_dir).resolve()), store_uri, address)
        try:
            placement = start_engines(ctx)
            logger.info("engines started: %s", placement)
            progress = start_progress()
            rollouts, updates = [], []
            for step in range(cfg.train.steps):
                # sync mode: the whole global batch, then every agent's update (concurrently), then sync
                rollout = rollout_step(ctx, step)
                futures = [
                    update_agent.submit(ctx, agent, step, rollout.samples_versions[agent]) for agent in cfg.agents
                ]
                step_updates: list[UpdateSummary] = [f.result() for f in futures]
                rollouts.append(rollout)
                updates.extend(step_updates)
                set_progress(progress, step + 1, cfg.train.steps)
                logger.info(
                    "step %d/%d | %s | %.0f tok/s | rollout %.1fs | update %.1fs",
                    step + 1, cfg.train.steps,
                    " ".join(f"{a} reward {r:.3f} v{u.policy_version}"
                             for (a, r), u in zip(rollout.mean_reward.items(), step_updates, strict=True)),
                    rollout.tokens_per_s, rollout.wall_s, max(u.train_s + u.sync_s for u in step_updates),
                )
            if cfg.train.save_checkpoints:
                for agent in cfg.agents:
                    save_checkpoint(ctx, agent)
            return publish_report(ctx, cfg, rollouts, updates, time.perf_counter() - t0)
        finally:
            Runtime.release(ctx)


if __name__ == "__main__":
    train_run(preset="tiny")
