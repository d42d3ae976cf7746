from __future__ import annotations

import base64
import json
from pathlib import Path
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from flexmarl.config import RunConfig
from flexmarl.orchestrator.report import build_report
from flexmarl.orchestrator.runtime import RunContext
from flexmarl.report.meg_picture import draw_run_meg
from flexmarl.report.pictures import draw_rewards
from flexmarl.report.series import load_series
from flexmarl.report.summary import agent_rows, render_summary
from flexmarl.run.timeline_file import read_timeline
from flexmarl.run.directory import RunDirectory
from flexmarl.run.layout import MEG_PICTURE, REPORT_FILE, REWARDS_PICTURE
from flexmarl.tracking.tracker import RunTracker
from tasks.updates import update_row


def png_data_url(path: Path) -> str:
    """A PNG inlined as a data URL: the flow run's artifacts show it without any file server."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def publish_meg(cfg: RunConfig, run_dir: str) -> None:
    """The run's multi-agent execution graph, drawn as the rollout runs it, as the ``meg`` image artifact."""
    picture = draw_run_meg(cfg, Path(run_dir, MEG_PICTURE))
    create_image_artifact(png_data_url(picture), key="meg", description="The multi-agent execution graph")


def start_progress() -> UUID:
    return create_progress_artifact(progress=0.0, key="training-progress", description="Agent updates done, in %")


def set_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=100.0 * done / total)


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(ctx: RunContext, timeline: str, wall_s: float) -> dict:
    """Write RUN_DIR/report.json from the run's config, store and ``timeline`` (the pipeline's timeline.json);
    publish the run summary (the same markdown as ``flexmarl report``'s report.md, without pictures), the
    per-agent metrics and updates tables and the reward curves as artifacts; log the run's figures to the
    experiment trackers."""
    run = RunDirectory(ctx.run_dir)
    result = read_timeline(Path(timeline))
    report = build_report(ctx, run.config, result, wall_s=wall_s)
    Path(ctx.run_dir, REPORT_FILE).write_text(json.dumps(report, indent=2))
    with RunTracker(run.config.tracking, run_dir=ctx.run_dir, run_name=ctx.run_id, config=run.config) as tracker:
        tracker.log_report(report)
    series = load_series(run, result)
    create_table_artifact(agent_rows(run, series, report), key="agent-metrics",
                          description=f"Per-agent metrics of run {ctx.run_id}")
    create_table_artifact([update_row(u) for u in result.updates], key="agent-updates",
                          description="Every agent update, in order")
    summary = render_summary(run, series, report=report, timeline=result)
    summary += f"\nPictures: `flexmarl report {ctx.run_dir}`\n"
    create_markdown_artifact(summary, key="run-summary", description="Run summary")
    rewards = draw_rewards(list(series.values()), Path(ctx.run_dir, REWARDS_PICTURE))
    create_image_artifact(png_data_url(rewards), key="agent-rewards",
                          description="Each agent's mean reward by step and over wall time")
    return report
