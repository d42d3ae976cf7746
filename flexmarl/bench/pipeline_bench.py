"""`flexmarl bench pipeline`: the schedules on one cluster, model, data and seed, interleaved and repeated.

It drives the engine on Dask directly (no Prefect), so it also runs on a machine with only torch,
pyarrow, dask and deltalake. Every mode starts from the same weights and samples with the same per-request
seeds, so with staleness 0 the trained weights of ``flexmarl`` must equal those of ``sync``.

On a shared machine the load changes from minute to minute, so modes run one after the other would compare
minutes, not schedules: each round runs every mode once (A B C A B C ...), and a mode's speedup over sync is
the median of its rounds' ratios (each against the sync run of its own round), with their spread. Each run
also gets a work-conserving lower bound on its wall time (``work_bound``) and its efficiency, bound / wall.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from distributed import Client

from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster
from flexmarl.config import PRESETS, ConfigError, RunConfig, load_config
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.orchestrator.report import weight_sync_costs
from flexmarl.orchestrator.runtime import RunContext, Runtime
from flexmarl.reference import DRIFT_TOLERANCE, initial_weights, max_weight_diff, weight_drift
from flexmarl.run.prepare import prepare_run
from flexmarl.report.timeline import draw_timeline
from flexmarl.run.layout import CHECKPOINTS_DIR, STATE_DIR
from flexmarl.training.state import tensor_bytes

# Each mode is a set of overrides of the same workload.
MODES: dict[str, list[str]] = {
    "sync": ["run.mode=sync", "rollout.load_balance=false"],
    "flexmarl": ["run.mode=flexmarl"],
    "no-lb": ["run.mode=flexmarl", "rollout.load_balance=false"],
    "no-pipeline": ["run.mode=flexmarl", "run.pipeline=false"],
    "stale1": ["run.mode=flexmarl", "run.max_staleness=1"],
    # flexmarl without cutting generation into micro-batch-sized batches (``rollout.micro_batch_generation``)
    "whole-batches": ["run.mode=flexmarl", "rollout.micro_batch_generation=false"],
    # an agent's trainer may span two slots (a trainer group, data parallel): flexmarl, and the sync baseline
    # given the same group training (the paper's baseline trained data-parallel too)
    "flexmarl-group": ["run.mode=flexmarl", "training.max_slots=2"],
    "sync-group": ["run.mode=sync", "rollout.load_balance=false", "training.max_slots=2"],
}

SMOLLM2 = "smollm2-135m-instruct"
# Workloads beyond the presets: a preset and the overrides that make it. `fan_out_smollm2` is the skewed
# fan-out with real models: every agent is SmolLM2-135M (the solver runs three times per query, with the
# longest answers), sized so that a step takes about a minute on this machine's 2 cores.
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "fan_out_smollm2": ("fan_out", [
        *(f"agents.{agent}.model={SMOLLM2}" for agent in ("planner", "solver", "aggregator")),
        "agents.solver.sampling.max_new_tokens=32",
        "run.queries_per_step=4",
        "training.lr=1e-5",
        "run.snapshot_every=4",  # a state is 1.7 GB: sparse states, as in the default preset
    ]),
}


def workload_config(workload: str, overrides: Sequence[str] = ()) -> RunConfig:
    """The config of a preset or of a named workload (``WORKLOADS``), with ``overrides`` applied last.

    Raises:
        ConfigError: neither a preset nor a named workload (both lists in the message), or a bad override.
    """
    if workload not in WORKLOADS and workload not in PRESETS:
        raise ConfigError(f"unknown workload {workload!r}; choose a preset {PRESETS} or one of {tuple(WORKLOADS)}")
    preset, extra = WORKLOADS.get(workload, (workload, []))
    return load_config(preset=preset, overrides=[*extra, *overrides])


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


def snapshot_cost(result: PipelineResult) -> dict:
    """The training states written (``run.snapshot_every``): how many, their worker-seconds, and their share
    of the run's worker-seconds (``share``; the same share of the wall time when they hold up the run)."""
    spans = [s for s in result.spans if s.kind == "snapshot"]
    seconds = sum(s.end - s.start for s in spans)
    return {"count": len(spans), "seconds": seconds,
            "share": seconds / (len(result.workers) * result.wall_s) if result.wall_s > 0 else 0.0}


def work_bound(result: PipelineResult) -> float:
    """A lower bound on the wall time of this run's work under any work-conserving schedule: its generation and
    training worker-seconds spread evenly over its workers, and no less than the longest agent's training (an
    agent's micro-batches and updates run one after another). Weight syncs and state moves are left out: they
    are the schedule's own overhead, which a better schedule could avoid, so efficiency = bound / wall time
    is below utilisation by what they cost."""
    work = sum(s.end - s.start for s in result.spans if s.kind in ("rollout", "train") and not s.background)
    train: dict[str, float] = defaultdict(float)
    for s in result.spans:
        if s.kind == "train" and not s.background:
            train[s.agent] += s.end - s.start
    return max(work / max(len(result.workers), 1), max(train.values(), default=0.0))


def work_split(result: PipelineResult) -> dict:
    """The run's worker-seconds of generation and of training, and its generation batches: how many, their mean
    size (requests generated together), and the seconds per generated token. Modes train the same micro-batches,
    so where their work differs, it is generation; these say whether smaller batches are why."""
    rollout = [s for s in result.spans if s.kind == "rollout"]
    gen_s = sum(s.end - s.start for s in rollout)
    tokens = sum(s.tokens for s in rollout)
    return {"generation_s": gen_s,
            "training_s": sum(s.end - s.start for s in result.spans if s.kind == "train" and not s.background),
            "batches": len(rollout),
            "mean_batch": sum(s.requests for s in rollout) / len(rollout) if rollout else 0.0,
            "ms_per_token": 1e3 * gen_s / tokens if tokens else 0.0}


def generation_by_batch(result: PipelineResult) -> dict[str, dict[int, dict]]:
    """Per agent and batch size (requests generated together): batches, worker-seconds and tokens."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for s in result.spans:
        if s.kind == "rollout":
            row = out[s.agent].setdefault(s.requests, {"batches": 0, "seconds": 0.0, "tokens": 0})
            row["batches"] += 1
            row["seconds"] += s.end - s.start
            row["tokens"] += s.tokens
    return {agent: dict(sorted(rows.items())) for agent, rows in sorted(out.items())}


def group_training(result: PipelineResult) -> dict:
    """The updates whose step spread over a trainer group (``training.max_slots``): how many, how many of them
    trained on more than one rank, and their all-reduce of the gradient sums (transfer seconds, in all and per
    grouped step, and its share of the run's worker-seconds: each rank waits for it)."""
    grouped = [u for u in result.updates if u.metrics.get("ranks", 1) > 1]
    reduce_s = [u.metrics.get("time/reduce_s", 0.0) for u in grouped]
    worker_s = sum(r * u.metrics["ranks"] for r, u in zip(reduce_s, grouped, strict=True))
    return {"updates": len(result.updates), "grouped": len(grouped),
            "trained_on_several_ranks": sum(u.metrics.get("ranks_trained", 1) > 1 for u in grouped),
            "reduce_s": sum(reduce_s), "reduce_s_per_grouped_step": sum(reduce_s) / len(grouped) if grouped else 0.0,
            "reduce_wait_s": sum(u.metrics.get("time/reduce_wait_s", 0.0) for u in grouped),
            "reduce_share": worker_s / (len(result.workers) * result.wall_s) if result.wall_s > 0 else 0.0}


def sync_bytes(weights: dict[str, dict]) -> dict[str, int]:
    """Bytes of each agent's weight sync per update: the tensors its trainer sends every replica (an adapter
    agent's: its adapter only)."""
    return {agent: tensor_bytes(w) for agent, w in weights.items()}


def _monitor_count(dask_worker) -> int:
    return dask_worker.monitor.count


def _peak_memory_since(counts: dict[str, int], dask_worker) -> int:
    """The worker's highest RSS in Dask's system monitor (sampled every 0.5 s) since ``counts[address]``."""
    history = dask_worker.monitor.range_query(counts.get(dask_worker.address, 0))["memory"]
    return int(max((m for m in history if m is not None), default=dask_worker.monitor.get_process_memory()))


def spread(values: Sequence[float]) -> dict:
    """Median, min and max of ``values`` (one per round)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> dict:
    """Run ``repeats`` rounds of ``modes`` (each round every mode once, in order) and write
    ``out_dir/bench.json``, ``timeline_<mode>.png``, ``rewards.png`` (each agent's reward against step and
    against wall time, every mode) and ``report.md``.

    A mode's ``wall_s``, ``bound_s`` and ``efficiency`` are medians over its rounds (``rounds`` has each
    round's); ``speedup_vs_sync`` gives the median and spread of the per-round ratios. The timelines, rewards
    and per-agent figures are those of the last round. Every file is rewritten after each round, so a bench
    stopped midway keeps the rounds it finished (``rounds_done``). Each agent's ``time_to_reward`` is the wall
    time at which its reward, averaged over its last ``SMOOTH`` updates, first reaches ``reward_threshold`` (None when
    it never does): the time to accuracy that a faster schedule has to win."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out_dir.mkdir(parents=True, exist_ok=True)

    def mode_config(mode: str) -> RunConfig:
        extra = [*overrides, *MODES[mode], f"run.steps={steps}"]
        return load_config(config, overrides=extra) if config else workload_config(workload, extra)

    cluster = cluster or mode_config(modes[0]).cluster
    report: dict = {"workload": str(config or workload), "steps": steps, "repeats": repeats, "modes": {},
                    "reward_threshold": reward_threshold}
    # only sync's final weights stay in memory (a SmolLM2 team's are 1.6 GB a mode, and four modes' of them, beside
    # the workers, ran this machine out of memory): every other mode's are compared with them at once
    sync_weights = start = None
    weight_diff: dict[str, float] = {}
    drift: dict[str, float] = {}  # per mode, its largest weight_drift from sync's over the rounds
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    with open_cluster(cluster) as address, Client(address, set_as_default=False) as client:
        for r in range(repeats):
            for mode in modes:  # interleaved: a noisy minute hits every mode alike
                log(f"round {r + 1}/{repeats}, mode {mode}: running {steps} steps")
                counts = client.run(_monitor_count)
                result, weights = _run_once(mode_config(mode), out_dir / mode, address)
                if mode == "sync":
                    sync_weights = weights
                    start = start or initial_weights(mode_config(mode))
                elif sync_weights is not None:
                    weight_diff[mode] = max(weight_diff.get(mode, 0.0), max_weight_diff(sync_weights, weights))
                    drift[mode] = max(drift.get(mode, 0.0), weight_drift(sync_weights, weights, start))
                peak = client.run(_peak_memory_since, counts)
                bound = work_bound(result)
                rounds[mode].append({"wall_s": result.wall_s, "bound_s": bound, "efficiency": bound / result.wall_s,
                                     "utilization": result.utilization(), "peak_rss_bytes": max(peak.values()),
                                     "driver_busy_share": result.driver_busy_share(),
                                     "driver_busy_by_step": list(result.driver_busy_by_step().values()),
                                     "snapshot_share": snapshot_cost(result)["share"], **work_split(result)})
                log(f"mode {mode}: {result.wall_s:.1f} s, utilisation {result.utilization():.0%}, "
                    f"efficiency {bound / result.wall_s:.0%}")
                # the latest round's details: after a round, bench.json holds every round done so far
                report["modes"][mode] = {**_details(result, steps, reward_threshold, out_dir, mode),
                                         "sync_bytes_per_update": sync_bytes(weights)}
                del weights
            report["workers"], report["rounds_done"] = len(result.workers), r + 1
            _summarise(report, rounds, weight_diff, drift, out_dir)
    return report


_VS_SYNC = {  # report key -> (sync's run, the mode's run of the same round) -> ratio
    "speedup_vs_sync": lambda s, x: s["wall_s"] / x["wall_s"],
    "bound_speedup_vs_sync": lambda s, x: s["wall_s"] / x["bound_s"],
    "schedule_gain_vs_sync": lambda s, x: x["efficiency"] / s["efficiency"],
    "work_ratio_vs_sync": lambda s, x: s["bound_s"] / x["bound_s"],
}


def _summarise(report: dict, rounds: dict[str, list[dict]], weight_diff: dict[str, float], drift: dict[str, float],
               out_dir: Path) -> None:
    """Medians and spreads over the rounds run so far, into ``report``; then write bench.json, report.md and
    rewards.png, so that a bench stopped in a later round keeps what the earlier ones measured.
    ``weight_diff`` and ``drift``: per mode, its largest weight difference and ``weight_drift`` from sync's over
    the rounds."""
    for mode, runs in rounds.items():
        report["modes"][mode].update({k: statistics.median(run[k] for run in runs)
                                      for k in ("wall_s", "bound_s", "efficiency", "utilization", "driver_busy_share",
                                                "snapshot_share", "generation_s", "training_s", "mean_batch",
                                                "ms_per_token")})
        report["modes"][mode]["peak_rss_per_worker_bytes"] = max(run["peak_rss_bytes"] for run in runs)
        report["modes"][mode]["wall_s_spread"] = spread([run["wall_s"] for run in runs])
        report["modes"][mode]["rounds"] = runs
    if "sync" in rounds:
        # speedup = schedule gain x work ratio. The gain (efficiency over sync's) is how much better the mode
        # packs its own work; the ratio (sync's bound over the mode's) holds what its work cost, which moves with
        # the machine's pace as well as with batch sizes: the same training took up to 40% longer in one mode's
        # run than in another's of the same round here. bound_speedup is what the mode's own work would allow
        # under a perfect schedule.
        for key, ratio in _VS_SYNC.items():
            report[key] = {m: spread([ratio(s, x) for s, x in zip(rounds["sync"], runs, strict=True)])
                           for m, runs in rounds.items()}
    if weight_diff:
        report["max_abs_weight_diff_vs_sync"] = dict(weight_diff)
        report["weight_drift_vs_sync"] = dict(drift)
        report["weights_match_sync"] = all(d <= DRIFT_TOLERANCE for d in drift.values())
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(markdown_table(report))
    from flexmarl.report.pictures import draw_mode_rewards

    draw_mode_rewards(report, out_dir / "rewards.png")


def _run_once(cfg: RunConfig, run_dir: Path, address: str) -> tuple[PipelineResult, dict]:
    shutil.rmtree(run_dir, ignore_errors=True)  # every run of a mode starts afresh
    result, weights = run_mode(cfg, run_dir, address)
    # The final weights are in memory; a SmolLM2 team's states and checkpoints are 5 GB a mode, and four modes'
    # of them filled this machine's disk mid-bench. The store, config and timeline stay for inspection.
    for name in (STATE_DIR, CHECKPOINTS_DIR):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return result, weights


def _details(result: PipelineResult, steps: int, reward_threshold: float, out_dir: Path, mode: str) -> dict:
    """What one run of a mode shows beyond its wall time: steps, samples, per-agent rewards, state moves; and
    its timeline picture."""
    per_agent: dict[str, dict] = {}
    for u in sorted(result.updates, key=lambda u: (u.agent, u.policy_version)):
        a = per_agent.setdefault(u.agent, {"updates": 0, "samples": 0, "tokens": 0, "finished_at": [], "reward": []})
        a["updates"] += 1
        a["samples"] += u.samples
        a["tokens"] += u.tokens
        a["finished_at"].append(round(u.finished_at, 3))
        a["reward"].append(u.mean_reward)
    for a in per_agent.values():
        a["time_to_reward"] = time_to_reward(a["reward"], a["finished_at"], reward_threshold)
    draw_timeline(result, out_dir / f"timeline_{mode}.png", title=mode)
    return {
        "step_s": step_times(result, steps),
        "samples": sum(a["samples"] for a in per_agent.values()),
        "tokens": result.tokens,
        "per_agent": per_agent,
        "state_moves": state_moves(result),
        "snapshots": snapshot_cost(result),
        "weight_sync": weight_sync_costs(result.syncs, sorted(per_agent)),
        "group_training": group_training(result),
        "generation_by_batch": generation_by_batch(result),
    }


def _ratio(x: dict | None) -> str:
    return "-" if x is None else f"{x['median']:.2f}x [{x['min']:.2f}, {x['max']:.2f}]"


def markdown_table(report: dict) -> str:
    lines = [
        f"# Pipeline benchmark: {report['workload']}, {report['steps']} steps, {report.get('workers')} workers",
        "",
        f"Medians of {report.get('rounds_done', report['repeats'])} interleaved rounds, [min, max] across rounds; "
        "the speedup is each round's sync wall time over the mode's; efficiency = work bound / wall time; "
        "speedup = schedule gain (efficiency over sync's) x work ratio (sync's bound over the mode's).",
        "",
        "| mode | wall s | speedup vs sync | schedule gain | work ratio | utilisation | bound s | efficiency | samples "
        "| tokens | sync MB/update | peak RSS/worker GB | driver busy | snapshots | generation s | training s "
        "| mean batch | ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        w = r["wall_s_spread"]
        speedup, gain, work = (_ratio(report.get(key, {}).get(mode))
                               for key in ("speedup_vs_sync", "schedule_gain_vs_sync", "work_ratio_vs_sync"))
        lines.append(
            f"| {mode} | {r['wall_s']:.2f} [{w['min']:.2f}, {w['max']:.2f}] | {speedup} | {gain} | {work} | "
            f"{r['utilization']:.0%} | "
            f"{r['bound_s']:.2f} | {r['efficiency']:.0%} | {r['samples']} | {r['tokens']} | "
            f"{sum(r['sync_bytes_per_update'].values()) / len(r['sync_bytes_per_update']) / 1e6:.2f} | "
            f"{r['peak_rss_per_worker_bytes'] / 1e9:.2f} | {r['driver_busy_share']:.0%} | "
            f"{r.get('snapshot_share', 0.0):.1%} | {r['generation_s']:.1f} | {r['training_s']:.1f} | "
            f"{r['mean_batch']:.1f} | {r['ms_per_token']:.1f} |"
        )
    if "weights_match_sync" in report:
        diffs = ", ".join(f"{m} {d:.2e} (drift {report['weight_drift_vs_sync'][m]:.1e} of the move)"
                          for m, d in report["max_abs_weight_diff_vs_sync"].items())
        lines += ["", f"weights_match_sync: {report['weights_match_sync']} (max abs diff: {diffs})"]
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
