"""The training flow: one FlexMARL run, as a Prefect flow.

Start it with ``flexmarl train``, from a deployment (``prefect deployment run 'flexmarl-train/tiny'``) or
from the Prefect UI. The flow only orchestrates: each task makes one coarse engine call; generation
batches and micro-batches run on Dask inside the pipeline. Every agent update is its own ``agent-update``
task run, from its step's admission until its weights are synced (or its agent's error), and the pipeline's
commits, syncs, moves and recoveries are Prefect events (``tasks/updates.py``).

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
from flexmarl.config import Preset, RunConfig, config_summary, load_config, run_overrides
from flexmarl.estimate import describe_estimate
from flexmarl.orchestrator.config import TrainMode
from flexmarl.orchestrator.channel import RunChannel
from flexmarl.orchestrator.runtime import CONFIG_FILE, RunContext, attempts, free_engines, prepare_run, resume_config
from flexmarl.preflight import check_inputs
from flexmarl.rollout.config import Backend
from flexmarl.run_lock import run_lock
from flexmarl.run_start import check_resumable, clear_failed_start
from flexmarl.tracking.tracker import RunTracker
from flexmarl.training.config import LossType
from flows.waiting import wait_for
from tasks.engines import save_checkpoint, start_engines
from tasks.pipeline import run_pipeline
from tasks.publish import publish_meg, publish_report, set_progress, start_progress
from tasks.updates import UpdateBoard, emit_run_failed, update_row


def resolve_config(config: str | None, preset: str | None, overrides: list[str]) -> RunConfig:
    return load_config(config, preset=None if config else (preset or "default"), overrides=overrides)


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
            'tiny' (a tiny model, for tests), 'fan_out' or 'copy'; used when ``config`` is not given.
        config: path of a config YAML file (instead of a preset).
        steps: optimizer steps per agent (train.steps).
        mode: 'flexmarl' (agents on their own clocks, micro-batches trained as they are committed) or 'sync'
            (the baseline: generate everything, barrier, train) (train.mode).
        queries_per_step: task inputs per step (train.queries_per_step).
        group_size: samples per input, the GRPO group (train.group_size).
        max_staleness: versions a sample's generator may lag the trained weights; 0 is on-policy
            (train.max_staleness).
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
    run_dir = resume or run_dir or default_run_dir()
    with run_lock(run_dir):  # one run at a time in a directory; `flexmarl train` holds it already (re-entrant)
        extra = run_overrides(overrides, dask_address, steps=steps, mode=mode, queries_per_step=queries_per_step,
                              group_size=group_size, max_staleness=max_staleness, lr=lr, loss_type=loss_type,
                              backend=backend)
        return _train(run_dir, t0, logger, config=config, preset=preset, overrides=extra, resume=resume)


def _train(run_dir: str, t0: float, logger, *, config: str | None, preset: str | None, overrides: list[str],
           resume: str | None) -> dict:
    # a retry of this flow run continues the run its earlier attempt started, never someone else's
    retried = flow_run.run_count > 1 and any(by == flow_run.id for _, by in attempts(run_dir))
    if resume or retried:
        cfg = resume_config(run_dir, overrides)
        check_resumable(cfg, run_dir)  # never train on a store that fails `flexmarl store verify`
    else:
        cfg = resolve_config(config, preset, overrides)
        if clear_failed_start(run_dir):
            logger.info("%s: took over an earlier start that failed before its first commit", run_dir)
    check_inputs(cfg)  # models and data, before the cluster starts (done once per process and config)
    run_id, store_uri = prepare_run(cfg, run_dir, resume=bool(resume or retried), started_by=flow_run.id)
    what = "resuming run" if resume or retried else "run"
    logger.info("%s %s in %s: %s; resolved config: %s", what, run_id, Path(run_dir).resolve(), config_summary(cfg),
                Path(run_dir).resolve() / CONFIG_FILE)
    logger.info("%s", describe_estimate(cfg))
    publish_meg(cfg, run_dir)

    try:  # a failure from here on leaves a run to resume: `flexmarl.run.failed` says where
        return _run(cfg, run_id, store_uri, run_dir, t0, logger)
    except Exception as exc:  # a stop on request (Ctrl-C, SIGTERM) is no failure, and is not told as one
        emit_run_failed(run_id, run_dir, exc)
        raise


def _run(cfg: RunConfig, run_id: str, store_uri: str, run_dir: str, t0: float, logger) -> dict:
    """Start the engines, run the pipeline while showing it in Prefect, then checkpoint and report.

    The tasks share no memory: each attaches to the run by its context and placement (small records), and
    the pipeline's events, the stop request and each update's outcome cross through the run's Dask scheduler.
    """
    tracker = RunTracker(cfg.tracking, run_dir=run_dir, run_name=run_id, config=cfg)  # checks before the cluster
    timeout_s = cfg.cluster.connect_timeout_s
    with open_cluster(cfg.cluster) as address, tracker, closing(connect(address, timeout_s=timeout_s)) as client:
        if tracker.enabled:
            logger.info("tracking: %s", ", ".join(tracker.enabled))
        ctx = RunContext(run_id, str(Path(run_dir).resolve()), store_uri, address)
        channel = RunChannel(client, address, run_id, timeout_s)
        pipeline = board = None
        try:
            placement = start_engines(ctx)
            logger.info("engines: %s", placement.describe())
            progress = start_progress()
            total = cfg.train.steps * len(cfg.agents)
            done = sum(min(v, cfg.train.steps) for v in placement.versions.values())  # resumed: done before
            board, pipeline = UpdateBoard(channel), run_pipeline.submit(ctx, placement)
            # The pipeline task has sent all its events once it ends; this ends their stream, however it ended.
            pipeline.add_done_callback(lambda _: channel.end_events())
            # What the pipeline tells goes to Prefect (task runs per update, events) and each recorded update
            # to the experiment trackers, from here, the driver.
            updates = []
            started = time.perf_counter()
            for event in channel.events():
                if (update := board.on(event)) is None:
                    continue
                updates.append(update_row(update))
                tracker.log_update(update)
                set_progress(progress, done + len(updates), total)
                left = (time.perf_counter() - started) / len(updates) * (total - done - len(updates))
                logger.info("progress: %d of %d agent updates; about %.0f min left", done + len(updates), total,
                            left / 60)
            try:
                outcome = wait_for(pipeline, "the rollout-and-train task", cfg.rollout.request_timeout_s,
                                   "rollout.request_timeout_s")
            finally:
                board.close(None if pipeline.state.is_completed() else pipeline.state.message)
            if cfg.train.save_checkpoints:
                for agent in cfg.agents:
                    save_checkpoint(ctx, outcome.placement, agent)
            report = publish_report(ctx, outcome.timeline, updates, time.perf_counter() - t0)
            tracker.log_report(report)
            return report
        finally:
            if pipeline is not None:  # a failed flow stops its pipeline before anything resumes the run
                channel.stop.set()
                pipeline.wait(timeout=cfg.rollout.request_timeout_s)
                board.close(pipeline.state.message or "the flow failed")  # a no-op if closed already
            free_engines(client, run_id, timeout_s)
            channel.close()


if __name__ == "__main__":
    train_run(preset="tiny")
