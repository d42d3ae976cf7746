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
from flexmarl.orchestrator.report import build_report
from flexmarl.orchestrator.runtime import RolloutSummary, RunContext, UpdateSummary


def start_progress() -> UUID:
    return create_progress_artifact(progress=0.0, key="training-progress", description="Steps done, in percent")


def set_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=100.0 * done / total)


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(
    ctx: RunContext, cfg: RunConfig, rollouts: list[RolloutSummary], updates: list[UpdateSummary], wall_s: float
) -> dict:
    """Write RUN_DIR/report.json and publish per-agent metrics as Prefect table and markdown artifacts."""
    report = build_report(ctx, cfg, rollouts, updates, wall_s=wall_s)
    Path(ctx.run_dir, "report.json").write_text(json.dumps(report, indent=2))
    rows = [
        {
            "agent": agent,
            "policy_version": a["policy_version"],
            "updates": a["updates"],
            "samples_generated": a["samples_generated"],
            "samples_trained": a["samples_trained"],
            "tokens_generated": a["tokens_generated"],
            "mean_reward_last": a["mean_reward"][-1] if a["mean_reward"] else None,
        }
        for agent, a in report["agents"].items()
    ]
    create_table_artifact(rows, key="agent-metrics", description=f"Per-agent metrics of run {ctx.run_id}")
    lines = [
        f"# FlexMARL run `{ctx.run_id}`",
        "",
        f"mode `{report['mode']}`, wall time {wall_s:.1f} s, store `{ctx.store_uri}`",
        "",
        "| step | rollout s | tokens/s | " + " | ".join(f"{a} reward" for a in report["agents"]) + " |",
        "|---|---|---|" + "---|" * len(report["agents"]),
    ]
    for i, s in enumerate(report["steps"]):
        rewards = " | ".join(_fmt(a["mean_reward"][i]) for a in report["agents"].values())
        lines.append(f"| {s['step']} | {s['rollout_s']:.1f} | {s['tokens_per_s']:.0f} | {rewards} |")
    create_markdown_artifact("\n".join(lines), key="run-summary", description="Per-step summary")
    return report


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
