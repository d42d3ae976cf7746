"""The training flow: one FlexMARL run, as a Prefect flow.

Start it with ``flexmarl train``, from a deployment (``prefect deployment run 'flexmarl-train/tiny'``) or
from the Prefect UI. The flow plans the run (``flexmarl/run/plan.py``: one check of everything, under the run
directory's lock) and then only orchestrates: engines, the pipeline task, checkpoints, the report. Each task
makes one coarse engine call; generation batches and micro-batches run on Dask inside the pipeline, and the
pipeline task shows the run as it goes (``tasks/run_view.py``): every agent update is its own
``agent-update`` task run, from its step's admission until its weights are synced (or its agent's error),
and the pipeline's commits, syncs, moves and recoveries are Prefect events.

``resume=RUN_DIR`` continues a run that crashed or was stopped, from its store and training-state snapshots.
A Prefect retry of the flow run (``train_run.with_options(retries=2)``) resumes the same way: the first
attempt's run directory, named from the flow run's scheduled start, is taken over by the next.
"""

from __future__ import annotations

import time
from contextlib import closing
from datetime import datetime
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flexmarl.cluster.local import connect, open_cluster
from flexmarl.config import Preset, config_summary, run_overrides
from flexmarl.estimate import describe_estimate
from flexmarl.orchestrator.channel import StopSignal
from flexmarl.orchestrator.config import TrainMode
from flexmarl.orchestrator.runtime import RunContext, free_engines
from flexmarl.rollout.config import Backend
from flexmarl.run.layout import CONFIG_FILE
from flexmarl.run.plan import RunPlan, RunRequest, locked_plan
from flexmarl.run.prepare import prepare
from flexmarl.training.config import LossType
from tasks.engines import save_checkpoint, start_engines
from tasks.events import emit_run_failed
from tasks.pipeline import run_pipeline
from tasks.publish import publish_meg, publish_report


def default_run_dir() -> str:
    # the flow run's scheduled start, not the clock: a retry of the flow run finds the same directory
    started = datetime.fromtimestamp(flow_run.scheduled_start_time.timestamp())
    return str(Path("runs") / started.strftime("%Y%m%d-%H%M%S"))


@flow(name="flexmarl-train", log_prints=True)
def train_run(
    preset: Preset | None = "default",
    config: str | None = None,
    steps: int | None = None,
    mode: TrainMode | None = None,
    queries_per_step: int | None = None,
    group_size: int | None = None,
    max_staleness: int | None = None,
    lr: float | None = None,
    loss_type: LossType | None = None,
    backend: Backend | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    dask_address: str | None = None,
    resume: str | None = None,
) -> dict:
    """Train every agent of a MEG with GRPO.

    The settings between ``steps`` and ``backend`` are the config's own (``RUN_FORM_SETTINGS`` in
    flexmarl/config.py names their keys); left empty, the config's value holds. docs/configuration.md
    describes each.

    Args:
        preset: a shipped config (flexmarl/presets/): 'default' (SmolLM2-135M solver -> verifier on two-number sums),
            'tiny' (a tiny model, for tests), 'fan_out', 'copy' or 'copy_team'; used when ``config`` is not given.
        config: path of a config YAML file (instead of a preset).
        steps: optimizer steps per agent (run.steps).
        mode: 'flexmarl' (agents on their own clocks, micro-batches trained as they are committed) or 'sync'
            (the baseline: generate everything, barrier, train) (run.mode).
        queries_per_step: task inputs per step (run.queries_per_step).
        group_size: samples per input, the GRPO group (run.group_size).
        max_staleness: versions a sample's generator may lag the trained weights; 0 is on-policy
            (run.max_staleness).
        lr: the agents' learning rate (training.lr).
        loss_type: 'grpo', 'dapo' or 'dr_grpo': how token losses are averaged (training.loss_type).
        backend: rollout generation backend, 'hf' or 'vllm' (rollout.backend).
        overrides: any other ``dotted.key=value`` settings, e.g. ``["training.clip_eps=0.1"]``; the typed
            fields above are applied after them.
        run_dir: where the store, checkpoints and report go (default ``runs/<time>``).
        dask_address: an existing Dask scheduler; default starts a LocalCluster.
        resume: the run directory of a run to continue; it takes the place of ``preset``, ``config`` and
            ``run_dir`` (the run keeps its own config), while ``steps``, ``dask_address`` and overrides of the
            settings a resumed run may change still apply.

    Returns:
        The run report (also written to ``RUN_DIR/report.json``).
    """
    logger = get_run_logger()
    t0 = time.perf_counter()
    extra = run_overrides(overrides, dask_address, steps=steps, mode=mode, queries_per_step=queries_per_step,
                          group_size=group_size, max_staleness=max_staleness, lr=lr, loss_type=loss_type,
                          backend=backend)
    request = RunRequest(resume or run_dir or default_run_dir(), config=config, preset=preset,
                         overrides=tuple(extra), resume=resume is not None,
                         retry_of=flow_run.id if flow_run.run_count > 1 else None)
    # one run at a time in a directory; `flexmarl train` holds the lock and the plan already (both re-entrant)
    with locked_plan(request) as plan:
        return _train(plan, t0, logger)


def _train(plan: RunPlan, t0: float, logger) -> dict:
    run = prepare(plan, started_by=flow_run.id)
    if run.took_over:
        logger.info("%s: took over an earlier start that failed before its first commit", plan.request.run_dir)
    logger.info("%s %s in %s: %s; resolved config: %s", "resuming run" if plan.resumes else "run", run.run_id,
                plan.run_dir, config_summary(plan.cfg), plan.run_dir / CONFIG_FILE)
    logger.info("%s", describe_estimate(plan.cfg))
    publish_meg(plan.cfg, str(plan.run_dir))

    try:  # a failure from here on leaves a run to resume: `flexmarl.run.failed` says where
        return _run(plan, run.run_id, t0, logger)
    except Exception as exc:  # a stop on request (Ctrl-C, SIGTERM) is no failure, and is not told as one
        emit_run_failed(run.run_id, str(plan.run_dir), exc)
        raise


def _run(plan: RunPlan, run_id: str, t0: float, logger) -> dict:
    """Start the engines, run the pipeline task (which shows the run as it goes), then checkpoint and report.

    The tasks share no memory: each attaches to the run by its context and placement (small records), and the
    stop request crosses through the run's Dask scheduler.
    """
    cfg, timeout_s = plan.cfg, plan.cfg.cluster.connect_timeout_s
    with open_cluster(cfg.cluster) as address, closing(connect(address, timeout_s=timeout_s)) as client:
        ctx = RunContext(run_id, str(plan.run_dir), plan.store_uri, address)
        stop = StopSignal(client, run_id)
        pipeline = None
        try:
            placement = start_engines(ctx)
            logger.info("engines: %s", placement.describe())
            pipeline = run_pipeline.submit(ctx, placement)
            outcome = pipeline.result()  # as long as the run: each of the pipeline's own waits is bounded
            if cfg.run.save_checkpoints:
                for agent in cfg.agents:
                    save_checkpoint(ctx, outcome.placement, agent)
            return publish_report(ctx, outcome.timeline, time.perf_counter() - t0)
        finally:
            if pipeline is not None:  # a failed flow stops its pipeline before anything resumes the run
                stop.set()
                pipeline.wait(timeout=cfg.rollout.request_timeout_s)
            free_engines(client, run_id, timeout_s)
            stop.clear()


if __name__ == "__main__":
    train_run(preset="tiny")
