"""The run summary in markdown: what ``report.md`` holds and the training flow publishes as an artifact.

One renderer for both, so the UI and the file cannot disagree: the run (mode, wall time, utilisation), its
agents (model, versions, samples, reward, loss), the versions each agent produced and when, each worker's
busy time by kind, and the resolved config.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping

from flexmarl.config import dump_config
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.report.series import AgentSeries
from flexmarl.run.directory import RunDirectory

KINDS = ("rollout", "train", "swap", "sync", "snapshot")


def agent_rows(run: RunDirectory, series: Mapping[str, AgentSeries], report: dict | None) -> list[dict]:
    """One row per agent: the per-agent metrics table (the ``agent-metrics`` artifact and report.md)."""
    rows = []
    for agent, s in series.items():
        counts = (report or {}).get("agents", {}).get(agent, {})
        rewards = [r for r in s.reward if r is not None]
        losses = [v for v in s.loss if v is not None]
        stale = [v for v in s.staleness if v is not None]
        rate = [v for v in s.tokens_per_s if v is not None]
        sync = counts.get("weight_sync", {})
        rows.append({
            "agent": agent,
            "model": run.config.agents[agent].model,
            "policy_version": max(s.versions, default=0),
            "updates": len(s.versions),
            "samples_generated": counts.get("samples_generated", sum(s.samples_by_version.values())),
            "samples_trained": counts.get("samples_trained"),
            "tokens_generated": counts.get("tokens_generated"),
            "mean_reward_first": _round(rewards[0]) if rewards else None,
            "mean_reward_last": _round(rewards[-1]) if rewards else None,
            "loss_last": _round(losses[-1]) if losses else None,
            "staleness_mean": _round(sum(stale) / len(stale)) if stale else None,
            "tokens_per_s_mean": _round(sum(rate) / len(rate)) if rate else None,
            "skipped_updates": sum(s.skipped),
            # what one update's weight sync costs: bytes to all the agent's replicas, and their seconds
            "sync_mb_per_update": _round(sync["bytes_per_update"] / 1e6) if sync else None,
            "sync_s_per_update": _round(sync["seconds_per_update"]) if sync else None,
            # replica loads from a trainer on the replica's own worker (device to device), of all of them
            "syncs_in_place": f"{sync.get('in_place_syncs', 0)}/{sync['replica_syncs']}" if sync else None,
        })
    return rows


def learned_lines(report: dict, window: int = 10) -> list[str]:
    """What each agent learned, in words: its mean training reward over its first and its last ``window``
    updates (fewer when it made fewer than twice as many), from the run's report.

    Example:
        >>> learned_lines({"agents": {"solver": {"mean_reward": [0.1, 0.3, None, 0.5, 0.7]}}}, window=2)
        ['solver: mean training reward 0.20 over updates 1-2, 0.60 over updates 4-5']
    """
    lines = []
    for agent, a in report["agents"].items():
        rewards = [(i + 1, r) for i, r in enumerate(a.get("mean_reward", [])) if r is not None]
        k = min(window, len(rewards) // 2)
        if k == 0:
            lines.append(f"{agent}: too few updates with a reward to compare ({len(rewards)})")
            continue
        first, last = rewards[:k], rewards[-k:]
        lines.append(f"{agent}: mean training reward {sum(r for _, r in first) / k:.2f} over updates "
                     f"{first[0][0]}-{first[-1][0]}, {sum(r for _, r in last) / k:.2f} over updates "
                     f"{last[0][0]}-{last[-1][0]}")
    return lines


def render_summary(
    run: RunDirectory,
    series: Mapping[str, AgentSeries],
    *,
    report: dict | None,
    timeline: PipelineResult | None,
    pictures: Mapping[str, str] | None = None,
) -> str:
    """The summary as markdown; ``pictures`` (caption -> relative path) adds a pictures section."""
    cfg = run.config
    run_id = (report or {}).get("run_id", run.path.name)
    lines = [f"# FlexMARL run `{run_id}`", ""]
    if report:
        lines += [
            f"- mode `{report['mode']}`, {report['workers']} workers, {len(cfg.agents)} agents, "
            f"{cfg.run.steps} steps of {cfg.run.queries_per_step} queries x {cfg.run.group_size}",
            f"- wall time {report['wall_s']:.1f} s (pipeline {report['pipeline_s']:.1f} s)",
            f"- worker utilisation {report['utilization']:.0%}, {report['tokens_per_s']:.0f} tokens/s generated; "
            f"driver busy {report.get('driver_busy_share', 0.0):.0%} of the pipeline's time"
            + (f" ({min(by_step.values()):.0%}-{max(by_step.values()):.0%} per step)"
               if (by_step := report.get("driver_busy_by_step")) else ""),
            f"- store: {report['store_write_s']:.2f} s of driver commits, {report['store_read_s']:.2f} s of "
            f"trainer reads, at `{run.store_uri}`",
        ]
    else:
        lines.append(f"- no report.json: the run has not finished (or failed); store at `{run.store_uri}`")
    lines += ["", "## Agents", ""]
    rows = agent_rows(run, series, report)
    cols = ["agent", "model", "policy_version", "updates", "samples_generated", "samples_trained",
            "mean_reward_first", "mean_reward_last", "loss_last", "staleness_mean", "tokens_per_s_mean",
            "skipped_updates", "sync_mb_per_update", "sync_s_per_update", "syncs_in_place"]
    lines += _table(cols, [[r[c] for c in cols] for r in rows])
    lines += ["", "## Versions", "",
              "Mean reward of each training step's samples, the seconds since the start at which each update "
              "finished, and the saved checkpoints.", ""]
    vrows = []
    for agent, s in series.items():
        rewards = " ".join("-" if r is None else f"{r:.2f}" for r in s.reward) or "none"
        times = ", ".join(f"v{v} {t:.1f}" for v, t in zip(s.versions, s.update_s, strict=True)) or "none"
        ckpts = ", ".join(f"v{v}" for v in run.checkpoints(agent)) or "none"
        vrows.append([agent, rewards, times, ckpts])
    lines += _table(["agent", "reward by step", "updates (version at seconds)", "checkpoints"], vrows)
    lines += ["", "## Utilisation", ""]
    if timeline is not None and timeline.wall_s > 0:
        lines += [f"Busy share of each worker's {timeline.wall_s:.1f} s, by kind of work "
                  f"(all workers: {timeline.utilization():.0%}).", ""]
        lines += _table(["worker", "busy", *KINDS], _utilisation_rows(timeline))
        if timeline.moves:
            gained = ", ".join(f"{a} {n}" for a, n in sorted(Counter(m.target for m in timeline.moves).items()))
            lines += ["", f"The inter-agent balancer moved {len(timeline.moves)} replicas (gained: {gained})."]
    elif report:
        lines += _table(["worker", "busy"], [[w, f"{u:.0%}"] for w, u in report["worker_utilization"].items()])
    else:
        lines.append("no timeline.json: utilisation is unknown")
    if pictures:
        lines += ["", "## Pictures", ""]
        for caption, rel in pictures.items():
            lines += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    lines += ["", "## Config", "", "```yaml", dump_config(cfg).rstrip(), "```", ""]
    return "\n".join(lines)


def _utilisation_rows(timeline: PipelineResult) -> list[list[str]]:
    busy: dict[str, dict[str, float]] = {w: defaultdict(float) for w in timeline.workers}
    for span in timeline.spans:
        busy.setdefault(span.worker, defaultdict(float))[span.kind] += span.end - span.start
    rows = []
    for i, worker in enumerate(timeline.workers):
        total = sum(busy[worker].values())
        rows.append([f"worker {i} (`{worker}`)", f"{total / timeline.wall_s:.0%}",
                     *(f"{busy[worker][k] / timeline.wall_s:.0%}" for k in KINDS)])
    return rows


def _table(cols: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        out.append("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")
    return out


def _round(x: float) -> float:
    return round(x, 4)
