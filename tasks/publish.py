from __future__ import annotations

import json
from pathlib import Path
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from flexmarl.config import RunConfig
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.orchestrator.report import build_report
from flexmarl.orchestrator.runtime import RunContext
from flexmarl.report.series import load_series
from flexmarl.report.summary import agent_rows, render_summary
from flexmarl.run.timeline_file import write_timeline
from flexmarl.run.directory import RunDirectory
from flexmarl.run.layout import REPORT_FILE, TIMELINE_FILE


def start_progress() -> UUID:
    return create_progress_artifact(progress=0.0, key="training-progress", description="Agent updates done, in %")


def set_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=100.0 * done / total)


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(
    ctx: RunContext, cfg: RunConfig, result: PipelineResult, updates: list[dict], wall_s: float
) -> dict:
    """Write RUN_DIR/report.json and timeline.json; publish the run summary (the same markdown as
    ``flexmarl report``'s report.md, without pictures) and the per-agent metrics table as artifacts."""
    report = build_report(ctx, cfg, result, wall_s=wall_s)
    Path(ctx.run_dir, REPORT_FILE).write_text(json.dumps(report, indent=2))
    write_timeline(result, Path(ctx.run_dir, TIMELINE_FILE))
    run = RunDirectory(ctx.run_dir)
    series = load_series(run, result)
    create_table_artifact(agent_rows(run, series, report), key="agent-metrics",
                          description=f"Per-agent metrics of run {ctx.run_id}")
    create_table_artifact(updates, key="agent-updates", description="Every agent update, in order")
    summary = render_summary(run, series, report=report, timeline=result)
    summary += f"\nPictures: `flexmarl report {ctx.run_dir}`\n"
    create_markdown_artifact(summary, key="run-summary", description="Run summary")
    return report
