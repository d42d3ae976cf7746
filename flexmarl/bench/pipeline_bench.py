"""`flexmarl bench pipeline`: the schedules one after the other on one cluster, model, data and seed.

It drives the engine on Dask directly (no Prefect), so it also runs on a machine with only torch,
pyarrow, dask and deltalake. Every mode starts from the same weights and samples with the same per-request
seeds, so with staleness 0 the trained weights of ``flexmarl`` must equal those of ``sync``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from flexmarl.report.timeline import draw_timeline
from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster
from flexmarl.config import RunConfig, load_config
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.orchestrator.runtime import RunContext, Runtime, prepare_run

# Each mode is a set of overrides of the same workload.
MODES: dict[str, list[str]] = {
    "sync": ["train.mode=sync", "rollout.load_balance=false"],
    "flexmarl": ["train.mode=flexmarl"],
    "no-lb": ["train.mode=flexmarl", "rollout.load_balance=false"],
    "no-pipeline": ["train.mode=flexmarl", "train.pipeline=false"],
    "stale1": ["train.mode=flexmarl", "train.max_staleness=1"],
}


def step_times(result: PipelineResult, steps: int) -> list[float]:
    """Seconds from one step's last agent update to the next's (the first from the start)."""
    ends = []
    for s in range(steps):
        done = [u.finished_at for u in result.updates if u.step == s]
        ends.append(max(done) if done else float("nan"))
    return [b - a for a, b in zip([0.0] + ends[:-1], ends, strict=True)]


SMOOTH = 5
"""Updates averaged when deciding that an agent's reward has reached the threshold."""


def time_to_reward(rewards: Sequence[float | None], finished_at: Sequence[float], threshold: float) -> float | None:
    """When the mean of the last ``SMOOTH`` rewards first reaches ``threshold`` (seconds since the start).

    Example:
        >>> time_to_reward([0.1, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9], [1, 2, 3, 4, 5, 6, 7], 0.7)
        6
    """
    for i in range(SMOOTH - 1, len(rewards)):
        window = [r for r in rewards[i - SMOOTH + 1 : i + 1] if r is not None]
        if window and sum(window) / len(window) >= threshold:
            return finished_at[i]
    return None


def state_moves(result: PipelineResult) -> dict:
    """How often agents' states moved between slots, and what it cost: ``swap_s`` is the time slots spent
    parking and resuming states (their task threads), ``load_s`` the part that loaded a state into its new
    trainer, and ``prefetch_read_s`` the reads done ahead of time in the background, overlapping training."""
    return {
        "moves": len(result.state_moves),
        "prefetched": sum(m.prefetched for m in result.state_moves),
        "swap_s": sum(s.end - s.start for s in result.spans if s.kind == "swap" and not s.background),
        "load_s": sum(m.load_s for m in result.state_moves),
        "prefetch_read_s": sum(m.prefetch_s for m in result.state_moves),
    }


def run_mode(cfg: RunConfig, run_dir: Path, address: str) -> tuple[PipelineResult, dict]:
    run_id, store_uri = prepare_run(cfg, run_dir)
    runtime = Runtime(RunContext(run_id, str(run_dir.resolve()), store_uri, address), cfg)
    try:
        runtime.start_engines()
        result = runtime.run()
        weights = {agent: runtime.weights(agent) for agent in cfg.agents}
    finally:
        runtime.close()
    return result, weights


def bench_pipeline(
    *,
    out_dir: Path,
    modes: Sequence[str],
    steps: int,
    workload: str = "fan_out",
    config: Path | None = None,
    overrides: Sequence[str] = (),
    cluster: ClusterConfig | None = None,
    reward_threshold: float = 0.5,
    log: Callable[[str], None] = print,
) -> dict:
    """Run ``modes`` in order and write ``out_dir/bench.json``, ``timeline_<mode>.png``, ``rewards.png`` (each
    agent's reward against step and against wall time, every mode) and ``report.md``.

    Each agent's ``time_to_reward`` is the wall time at which its reward, averaged over its last
    ``SMOOTH`` updates, first reaches ``reward_threshold`` (None when it never does): the time to accuracy
    that a faster schedule has to win."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    out_dir.mkdir(parents=True, exist_ok=True)

    def mode_config(mode: str) -> RunConfig:
        extra = [*overrides, *MODES[mode], f"train.steps={steps}"]
        return load_config(config, overrides=extra) if config else load_config(preset=workload, overrides=extra)

    cluster = cluster or mode_config(modes[0]).cluster
    report: dict = {"workload": str(config or workload), "steps": steps, "modes": {}}
    weights: dict[str, dict] = {}
    with open_cluster(cluster) as address:
        for mode in modes:
            log(f"mode {mode}: running {steps} steps")
            shutil.rmtree(out_dir / mode, ignore_errors=True)  # each benchmark run starts its modes afresh
            t0 = time.perf_counter()
            result, weights[mode] = run_mode(mode_config(mode), out_dir / mode, address)
            report["workers"] = len(result.workers)
            per_agent = {}
            for u in sorted(result.updates, key=lambda u: (u.agent, u.policy_version)):
                a = per_agent.setdefault(u.agent, {"updates": 0, "samples": 0, "tokens": 0, "finished_at": [],
                                                   "reward": []})
                a["updates"] += 1
                a["samples"] += u.samples
                a["tokens"] += u.tokens
                a["finished_at"].append(round(u.finished_at, 3))
                a["reward"].append(u.mean_reward)
            for a in per_agent.values():
                a["time_to_reward"] = time_to_reward(a["reward"], a["finished_at"], reward_threshold)
            report["modes"][mode] = {
                "wall_s": result.wall_s,
                "setup_s": time.perf_counter() - t0 - result.wall_s,
                "step_s": step_times(result, steps),
                "samples": sum(a["samples"] for a in per_agent.values()),
                "tokens": result.tokens,
                "utilization": result.utilization(),
                "per_agent": per_agent,
                "state_moves": state_moves(result),
            }
            draw_timeline(result, out_dir / f"timeline_{mode}.png", title=mode)
            log(f"mode {mode}: {result.wall_s:.1f} s, utilisation {result.utilization():.0%}")

    if "sync" in report["modes"]:
        base = report["modes"]["sync"]["wall_s"]
        report["speedup_vs_sync"] = {m: base / r["wall_s"] for m, r in report["modes"].items()}
    if "sync" in weights and "flexmarl" in weights:
        diff = max(
            float((weights["sync"][a][k] - weights["flexmarl"][a][k]).abs().max())
            for a in weights["sync"] for k in weights["sync"][a]
        )
        report["max_abs_weight_diff"] = diff
        report["weights_match_sync"] = diff <= 1e-5
    report["reward_threshold"] = reward_threshold
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(markdown_table(report))
    from flexmarl.report.pictures import draw_mode_rewards

    draw_mode_rewards(report, out_dir / "rewards.png")
    return report


def markdown_table(report: dict) -> str:
    lines = [
        f"# Pipeline benchmark: {report['workload']}, {report['steps']} steps, {report.get('workers')} workers",
        "",
        "| mode | wall s | speedup vs sync | utilisation | samples | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        speedup = report.get("speedup_vs_sync", {}).get(mode)
        lines.append(
            f"| {mode} | {r['wall_s']:.2f} | {'-' if speedup is None else f'{speedup:.2f}x'} | "
            f"{r['utilization']:.0%} | {r['samples']} | {r['tokens']} |"
        )
    if "weights_match_sync" in report:
        lines += ["", f"weights_match_sync: {report['weights_match_sync']} "
                      f"(max abs diff {report['max_abs_weight_diff']:.2e})"]
    threshold = report.get("reward_threshold")
    if threshold is not None:
        agents = sorted({a for r in report["modes"].values() for a in r["per_agent"]})
        lines += ["", f"Seconds until the mean reward of {SMOOTH} updates reaches {threshold} ('-': never):", "",
                  "| mode | " + " | ".join(agents) + " |", "|---|" + "---|" * len(agents)]
        for mode, r in report["modes"].items():
            cells = [r["per_agent"].get(a, {}).get("time_to_reward") for a in agents]
            lines.append(f"| {mode} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
        lines += ["", "![rewards](rewards.png)"]
    lines += ["", *[f"![{m}](timeline_{m}.png)" for m in report["modes"]]]
    return "\n".join(lines) + "\n"
