"""`flexmarl bench ...`: benchmarks that write JSON reports (speed is measured here, never asserted in tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.table import Table

from flexmarl.rollout.config import Decode
from flows.cli_output import console, fail

bench_app = typer.Typer(help="Run a benchmark and write its JSON report.", no_args_is_help=True)


@bench_app.command("pipeline")
def pipeline(
    out: Annotated[Path, typer.Option(help="Output directory for bench.json, timelines and report.md.")],
    modes: Annotated[str, typer.Option(
        help="Comma-separated: sync,flexmarl,no-lb,no-pipeline,stale1,whole-batches,flexmarl-group,sync-group.")
    ] = "sync,flexmarl",
    steps: Annotated[int, typer.Option(help="Optimizer steps per agent and mode.")] = 3,
    workload: Annotated[str, typer.Option(help="Preset of the workload: fan_out (skewed), copy (learns), tiny, "
                                          "default (SmolLM2); or fan_out_smollm2 (the skewed fan-out with "
                                          "SmolLM2 agents).")] = "fan_out",
    config: Annotated[Optional[Path], typer.Option(help="A config file instead of a preset workload.")] = None,
    reward_threshold: Annotated[float, typer.Option(help="Reward whose first arrival (mean of 5 updates) each "
                                                    "mode's time_to_reward reports.")] = 0.5,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds; each runs every mode once (interleaved), the "
                                         "report gives medians and spreads.")] = 3,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Run the schedules on the same cluster, model, data and seed, in interleaved rounds; medians and spreads
    of wall time, speedup and efficiency (work bound / wall); reward against step and wall time per mode in
    rewards.png, and each agent's time to --reward-threshold."""
    from flexmarl.bench.pipeline_bench import bench_pipeline
    from flexmarl.config import ConfigError

    try:
        bench_pipeline(
            out_dir=out, modes=[m.strip() for m in modes.split(",") if m.strip()], steps=steps,
            workload=workload, config=config, overrides=set_ or [], reward_threshold=reward_threshold,
            repeats=repeats, log=console.print,
        )
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    console.print((out / "report.md").read_text(), markup=False)


@bench_app.command("rollout")
def rollout(
    out: Annotated[Path, typer.Option(help="Output directory for bench_rollout.json and pictures.")],
    repeats: Annotated[int, typer.Option(min=1, help="Runs of each way; the report gives medians.")] = 3,
    workload: Annotated[str, typer.Option(help="Preset of the skewed workload.")] = "fan_out",
    backend_model: Annotated[str, typer.Option(help="Model of the backend tokens/s figures.")] = "tiny-large",
) -> None:
    """Layered vs dependency-parallel sampling, with vs without inter-agent balancing, and each backend's
    tokens/s, in one run."""
    from flexmarl.bench.rollout_bench import bench_rollout

    report = bench_rollout(out_dir=out, workload=workload, repeats=repeats, backend_model=backend_model,
                           log=console.print)
    dp, lb = report["dependency_parallel"], report["balancing"]
    table = Table(title=f"rollout of {report['episodes']} episodes ({report['tokens']} tokens), median of {repeats}")
    for col in ("way", "wall s", "speedup"):
        table.add_column(col)
    table.add_row("layered", f"{dp['layered_s']:.2f}", "")
    table.add_row("dependency-parallel", f"{dp['dependency_s']:.2f}", f"{dp['speedup']:.2f}x vs layered")
    table.add_row("without balancing", f"{lb['without_lb']['wall_s']:.2f}", "")
    table.add_row("with balancing", f"{lb['with_lb']['wall_s']:.2f}",
                  f"{lb['speedup']:.2f}x, {lb['with_lb']['capacity_moves']} slot moves")
    console.print(table)
    for name, b in report["backends"].items():
        console.print(f"{name}: " + (f"{b['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in b else b["unavailable"]))
    console.print(f"report: {out / 'bench_rollout.json'}")


@bench_app.command("decode")
def decode(
    out: Annotated[Path, typer.Option(help="Output directory for bench_decode.json.")],
    model: Annotated[str, typer.Option(help="Model setting.")] = "smollm2-135m-instruct",
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "16,64",
    new_tokens: Annotated[int, typer.Option(min=1, help="New tokens per request.")] = 64,
    group: Annotated[int, typer.Option(min=1, help="Requests per prompt, as in a GRPO group (each batch size "
                                       "must be a multiple); 1: every prompt differs.")] = 1,
    decode: Annotated[Decode, typer.Option(help="The hf backend's decode step (rollout.decode): dynamic, static "
                                           "or compiled.")] = "dynamic",
) -> None:
    """Each backend's decode tokens/s beside what this machine allows the model at that batch: a roofline of
    one decode step from the measured matmul rate and memory bandwidth, and the step's linear layers timed
    alone (flexmarl/bench/decode_limit.py)."""
    from flexmarl.bench.backend_bench import compare_backends

    sizes = [int(b) for b in batches.split(",") if b.strip()]
    uneven = [b for b in sizes if b % group]
    if uneven:
        fail(f"--batches {uneven} are not multiples of --group {group}; pick batch sizes that are")
    results = [compare_backends(model, b, new_tokens, group=group, decode=decode) for b in sizes]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.json").write_text(json.dumps({"model": model, "results": results}, indent=2))
    threads = results[0]["limit"]["torch_threads"]
    table = Table(title=f"{model}: decode tokens/s, {new_tokens} new tokens, {group} request(s) per prompt, "
                        f"{threads} torch thread(s) (a run's workers have one each: OMP_NUM_THREADS=1)")
    for col in ("batch", "roofline", "linear layers alone", "hf (of roofline, of linear)", "hf sampler share",
                "vllm"):
        table.add_column(col)
    for r in results:
        limit = r["limit"]
        cells = [f"{b['tokens_per_s']:.0f} ({b['share_of_limit']:.0%}, {b['share_of_kernel']:.0%})"
                 if "tokens_per_s" in b else "-" for b in (r["backends"]["hf"], r["backends"]["vllm"])]
        table.add_row(str(r["batch"]), f"{limit['tokens_per_s']:.0f} ({limit['bound']}-bound: "
                      f"{limit['matmul_gflops']:.0f} GFLOP/s, {limit['memory_gb_s']:.0f} GB/s)",
                      f"{limit['kernel_tokens_per_s']:.0f} ({limit['linear_gb_s']:.1f} GB/s of weights)", cells[0],
                      f"{r['backends']['hf'].get('sampler_share', 0):.1%}", cells[1])
    console.print(table)
    console.print(f"report: {out / 'bench_decode.json'}")


@bench_app.command("swap")
def swap(
    out: Annotated[Path, typer.Option(help="Output directory for bench_swap.json.")],
    models: Annotated[str, typer.Option(help="Comma-separated model settings.")] = "tiny,smollm2-135m-instruct",
    adapter_rank: Annotated[int, typer.Option(min=0, help="Also a LoRA adapter agent of this rank on each model "
                                                           "(0: full-model agents only).")] = 8,
    ranks: Annotated[int, typer.Option(min=0, help="Also the state sharded over this many worker processes "
                                                    "(training.sharding), against one (0: not).")] = 2,
    sharding: Annotated[Literal["full", "optimizer"], typer.Option(
        help="How --ranks shard the state: 'full' (FSDP2) or 'optimizer' (ZeRO-1).")] = "full",
) -> None:
    """Time moving an agent's whole training state device <-> host <-> disk <-> object store, and check it
    is bit-exact: for a full-model agent and for a LoRA adapter agent on each model; and a sharded state's
    bytes and peak memory per rank, parked and resumed over the same ranks, over one and back."""
    from flexmarl.bench.swap_bench import bench_swap

    report = bench_swap([m.strip() for m in models.split(",") if m.strip()], log=console.print,
                        adapter_rank=adapter_rank, ranks=ranks, sharding=sharding)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_swap.json").write_text(json.dumps(report, indent=2))
    rows = list(report["models"].items())
    rows += [(f"{m} (LoRA r={r['r']})", r) for m, r in report["adapters"].items()]
    for model, r in rows:
        console.print(
            f"{model}: {r['state_bytes'] / 1e6:.1f} MB, to host {r['to_host_gb_per_s']:.2f} GB/s, "
            f"to device {r['to_device_gb_per_s']:.2f} GB/s, to disk {r['to_disk_gb_per_s']:.2f} GB/s, "
            f"from disk {r['from_disk_gb_per_s']:.2f} GB/s, to/from {r['object_store']} object store "
            f"{r['to_object_store_gb_per_s']:.2f}/{r['from_object_store_gb_per_s']:.2f} GB/s, "
            f"bit exact {r['bit_exact']} ({r['device']}{', pinned' if r['pinned'] else ''})"
        )
    for model, r in report["sharded"].items():
        rss = ", ".join(f"{b / 1e6:.0f}" for b in r["rank_peak_rss_over_start_bytes"])
        console.print(
            f"{model} sharded ({r['sharding']}) over {r['ranks']}: {r['whole_state_bytes'] / 1e6:.1f} MB, per rank "
            f"{max(r['rank_state_bytes']) / 1e6:.1f} MB; peak memory per rank {rss} MB against "
            f"{r['one_rank_peak_rss_over_start_bytes'] / 1e6:.0f} MB on one; park {r['park_s']:.2f} s, resume "
            f"{r['resume_s']:.2f} s, onto one rank {r['reshard_to_one_s']:.2f} s and back {r['reshard_back_s']:.2f} s, "
            f"bit exact {r['bit_exact']}"
        )


@bench_app.command("adapters")
def adapters(
    out: Annotated[Path, typer.Option(help="Output directory for bench_adapters.json.")],
    model: Annotated[str, typer.Option(help="The agents' model setting.")] = "smollm2-135m-instruct",
    agents: Annotated[str, typer.Option(help="Comma-separated agent counts.")] = "2,4",
    rank: Annotated[int, typer.Option(help="LoRA rank of the adapter agents.")] = 8,
) -> None:
    """Bytes per weight sync and per state swap, and a worker's peak memory, for full-model against LoRA adapter
    agents (one fresh process per case)."""
    from flexmarl.bench.adapter_bench import bench_adapters
    from flexmarl.models.adapter_config import AdapterConfig

    counts = [int(n) for n in agents.split(",") if n.strip()]
    report = bench_adapters(model, counts, AdapterConfig(r=rank, alpha=2 * rank), log=console.print)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_adapters.json").write_text(json.dumps(report, indent=2))
    table = Table(title=f"{model}: full-model against LoRA r={rank} agents, one worker holding every agent")
    for col in ("agents", "kind", "peak RSS MB", "sync MB / update", "swap MB"):
        table.add_column(col)
    for r in report["runs"]:
        table.add_row(str(r["agents"]), r["kind"], f"{r['peak_rss_bytes'] / 1e6:.0f}",
                      f"{r['sync_bytes_per_update'] / 1e6:.2f}", f"{r['swap_bytes'] / 1e6:.2f}")
    console.print(table)
    console.print(f"report: {out / 'bench_adapters.json'}")


@bench_app.command("store")
def bench_store(
    out: Annotated[Path, typer.Option(help="Directory for bench_store.json (and the scratch stores).")],
    commits: Annotated[int, typer.Option(min=2, help="Micro-batch commits per store.")] = 1000,
    rows_per_commit: Annotated[int, typer.Option(min=1, help="Rows per micro-batch.")] = 64,
    compact_after_files: Annotated[int, typer.Option(min=1, help="Threshold of the compacting store.")] = 200,
) -> None:
    """Append and micro-batch read latency of the experience store, with and without automatic compaction."""
    from flexmarl.bench.store_bench import run_store_bench

    out.mkdir(parents=True, exist_ok=True)
    report = run_store_bench(out, commits=commits, rows_per_commit=rows_per_commit,
                             compact_after_files=compact_after_files)
    path = out / "bench_store.json"
    path.write_text(json.dumps(report, indent=2))
    table = Table(title=f"store: {commits} commits of {rows_per_commit} rows")
    for col in ("store", "append p50 ms", "append p99 ms", "rows/s", "read p50 ms", "read p99 ms", "files"):
        table.add_column(col)
    for name, a in report["append"].items():
        r = report["read"][name]["latency"]
        table.add_row(name, str(a["latency"]["p50_ms"]), str(a["latency"]["p99_ms"]), str(a["rows_per_s"]),
                      str(r["p50_ms"]), str(r["p99_ms"]), str(a["final_files"]))
    console.print(table)
    console.print(f"report: {path}")


@bench_app.command("chaos")
def chaos(
    out: Annotated[Path, typer.Option(help="Output directory for chaos.json and the runs' directories.")],
    preset: Annotated[str, typer.Option(help="Workload preset.")] = "tiny",
    faults: Annotated[int, typer.Option(min=1, help="Faults to inject, one run each.")] = 6,
    seed: Annotated[int, typer.Option(help="Draws the kinds of fault and where they strike.")] = 0,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Inject real faults (killed and frozen workers, a killed driver; with training.max_slots > 1, a killed rank
    of a trainer group) into tiny runs; check none lost a sample."""
    from flexmarl.bench.chaos_bench import bench_chaos
    from flexmarl.config import ConfigError

    try:
        report = bench_chaos(out_dir=out, preset=preset, faults=faults, seed=seed, overrides=set_ or [],
                             log=console.print)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    table = Table(title=f"chaos: {report['faults_injected']} faults, {report['runs_completed']} runs completed")
    for col in ("fault", "at", "recovered s", "lost", "duplicated", "skipped", "max weight diff", "drift of move",
                "verify"):
        table.add_column(col)
    for r in report["runs"]:
        recovered = "-" if r["recovered_s"] is None else f"{r['recovered_s']:.2f}"
        table.add_row(r["kind"], r["at"], recovered, str(r["samples_lost"]),
                      str(r["samples_duplicated"] + r["samples_unplanned"]), str(r["prompts_skipped"]),
                      f"{r['max_weight_diff']:.1e}", f"{r['weight_drift']:.1e}", str(r["verify_violations"] or "ok"))
    console.print(table)
    console.print(f"weights_match_uninterrupted: {report['weights_match_uninterrupted']}; report: {out / 'chaos.json'}")


def train_with_flow(config_file: Path, run_dir: Path, address: str) -> dict:
    """Train as `flexmarl train` does: the flexmarl-train Prefect flow, here on the bench's Dask cluster."""
    from flows.train import train_run

    return train_run(config=str(config_file), run_dir=str(run_dir), dask_address=address)


@bench_app.command("learning")
def learning(
    out: Annotated[Path, typer.Option(
        help="Output directory for learning.json, learning.png, the episodes and the runs.")],
    steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps per agent (default 40).")] = None,
    n_eval: Annotated[Optional[int], typer.Option(min=1, help="Held-out problems scored, base and trained "
                                                  "(default 500).")] = None,
    gsm8k_n: Annotated[Optional[int], typer.Option(min=0, help="GSM8K test problems scored beside them "
                                                   "(default 0: none).")] = None,
    single: Annotated[bool, typer.Option(help="Also train and score a single solver at the team's compute.")] = True,
    preset: Annotated[str, typer.Option(help="Workload: default (SmolLM2-135M) or tiny (for tests).")] = "default",
    data_dir: Annotated[Optional[Path], typer.Option(help="Directory with the GSM8K test.jsonl "
                                                     "(default ../shared/data/gsm8k beside the repository).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Score the base team on held-out problems, train it, score it again; train a single solver with the team's
    samples and updates and score it beside the team.

    Held-out problems come from the preset's dataset under a seed no run uses and share no arithmetic
    expression with the training stream; accuracy is greedy, through the team's own graph, with 95% Wilson
    intervals. The verifier is reported beside the base verifier and the two trivial ones (always yes, always
    no). Budget on top of the preset: flexmarl/bench/learning_bench.py BUDGET (docs/performance.md, "Learning").
    """
    from flexmarl.bench.learning_bench import GSM8K_DIR, GSM8K_N, N_EVAL, plan_learning, run_learning_bench
    from flexmarl.config import ConfigError
    from flows.evaluate import number, share
    from flows.prefect_server import PrefectAPIError, prefect_api

    try:
        plan = plan_learning(out, preset=preset, steps=steps, n_eval=n_eval or N_EVAL, overrides=set_ or [],
                             data_dir=data_dir or GSM8K_DIR, gsm8k_n=GSM8K_N if gsm8k_n is None else gsm8k_n,
                             single=single)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))

    try:
        with prefect_api() as url:
            console.print(f"Prefect API: {url}")
            report = run_learning_bench(plan, out, train=train_with_flow, log=console.print)
    except PrefectAPIError as exc:
        fail(str(exc))

    table = Table(title=f"{report['n_eval']} held-out problems, greedy, after {report['steps']} steps "
                        f"({report['wall_s']:.0f} s)")
    table.add_column("")
    table.add_column("accuracy [95% Wilson]")
    for name, key in (("base solver", "base_accuracy"), ("trained solver alone", "solver_accuracy"),
                      ("trained team", "team_accuracy"),
                      ("single solver, equal compute", "single_equal_compute_accuracy"),
                      (f"its majority of {report.get('majority_k')}", "majority_vote_accuracy")):
        if key in report:
            table.add_row(name, share(report[key]))
    console.print(table)
    verifier = report["verifier"]
    if verifier:
        for stage in ("base", "trained"):
            v = verifier[stage]
            console.print(f"{stage} verifier on the trained solver's answers: right answers accepted "
                          f"{v['tpr']['accuracy']:.3f}, wrong rejected {v['tnr']['accuracy']:.3f}, balanced "
                          f"{number(v['balanced'])}, unparsed {v['unparsed']:.3f}", highlight=False)
    console.print(f"picture: {out / 'learning.png'}")
    console.print(f"report: {out / 'learning.json'}")
