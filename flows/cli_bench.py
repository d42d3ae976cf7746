"""`flexmarl bench ...`: benchmarks that write JSON reports (speed is measured here, never asserted in tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flows.cli_output import console, fail

bench_app = typer.Typer(help="Run a benchmark and write its JSON report.", no_args_is_help=True)


@bench_app.command("pipeline")
def pipeline(
    out: Annotated[Path, typer.Option(help="Output directory for bench.json, timelines and report.md.")],
    modes: Annotated[str, typer.Option(help="Comma-separated: sync,flexmarl,no-lb,no-pipeline,stale1.")] = "sync,flexmarl",
    steps: Annotated[int, typer.Option(help="Optimizer steps per agent and mode.")] = 3,
    workload: Annotated[str, typer.Option(help="Preset of the workload: fan_out (skewed) or tiny.")] = "fan_out",
    config: Annotated[Optional[Path], typer.Option(help="A config file instead of a preset workload.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Run the schedules one after the other on the same cluster, model, data and seed."""
    from flexmarl.bench.pipeline_bench import bench_pipeline
    from flexmarl.config import ConfigError

    try:
        report = bench_pipeline(
            out_dir=out, modes=[m.strip() for m in modes.split(",") if m.strip()], steps=steps,
            workload=workload, config=config, overrides=set_ or [], log=console.print,
        )
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    console.print((out / "report.md").read_text(), markup=False)


@bench_app.command("swap")
def swap(
    out: Annotated[Path, typer.Option(help="Output directory for bench_swap.json.")],
    models: Annotated[str, typer.Option(help="Comma-separated model settings.")] = "tiny,smollm2-135m-instruct",
) -> None:
    """Time moving an agent's whole training state device <-> host <-> disk, and check it is bit-exact."""
    from flexmarl.bench.swap_bench import bench_swap

    report = bench_swap([m.strip() for m in models.split(",") if m.strip()], log=console.print)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_swap.json").write_text(json.dumps(report, indent=2))
    for model, r in report["models"].items():
        console.print(
            f"{model}: {r['state_bytes'] / 1e6:.1f} MB, to host {r['to_host_gb_per_s']:.2f} GB/s, "
            f"to device {r['to_device_gb_per_s']:.2f} GB/s, to disk {r['to_disk_gb_per_s']:.2f} GB/s, "
            f"from disk {r['from_disk_gb_per_s']:.2f} GB/s, bit exact {r['bit_exact']} ({r['device']})"
        )


@bench_app.command("store")
def bench_store(
    out: Annotated[Path, typer.Option(help="Directory for bench_store.json (and the scratch stores).")],
    commits: Annotated[int, typer.Option(min=2, help="Micro-batch commits per store.")] = 1000,
    rows_per_commit: Annotated[int, typer.Option(min=1, help="Rows per micro-batch.")] = 64,
    compact_after_files: Annotated[int, typer.Option(min=1, help="Threshold of the compacting store.")] = 200,
) -> None:
    """Append and ready() latency of the experience store, with and without automatic compaction."""
    from flexmarl.bench.store_bench import run_store_bench

    out.mkdir(parents=True, exist_ok=True)
    report = run_store_bench(out, commits=commits, rows_per_commit=rows_per_commit,
                             compact_after_files=compact_after_files)
    path = out / "bench_store.json"
    path.write_text(json.dumps(report, indent=2))
    table = Table(title=f"store: {commits} commits of {rows_per_commit} rows")
    for col in ("store", "append p50 ms", "append p99 ms", "rows/s", "ready p50 ms", "ready p99 ms", "files"):
        table.add_column(col)
    for name, a in report["append"].items():
        r = report["ready"][name]["latency"]
        table.add_row(name, str(a["latency"]["p50_ms"]), str(a["latency"]["p99_ms"]), str(a["rows_per_s"]),
                      str(r["p50_ms"]), str(r["p99_ms"]), str(a["final_files"]))
    console.print(table)
    console.print(f"report: {path}")


def train_with_flow(config_file: Path, run_dir: Path, address: str) -> dict:
    """Train as `flexmarl train` does: the flexmarl-train Prefect flow, here on the bench's Dask cluster."""
    from flows.train import train_run

    return train_run(config=str(config_file), run_dir=str(run_dir), dask_address=address)


@bench_app.command("learning")
def learning(
    out: Annotated[Path, typer.Option(help="Output directory for learning.json, eval_answers.jsonl and the run.")],
    steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps per agent (default 12: about an "
                                                 "hour with scoring, on 2 free CPU cores).")] = None,
    n_eval: Annotated[Optional[int], typer.Option(min=1, help="Held-out problems scored, base and trained "
                                                  "(default 128).")] = None,
    preset: Annotated[str, typer.Option(help="Workload: default (SmolLM2-135M) or tiny (for tests).")] = "default",
    data_dir: Annotated[Optional[Path], typer.Option(help="Directory with GSM8K train.jsonl and test.jsonl "
                                                     "(default ../shared/data/gsm8k beside the repository).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Score the base solver -> verifier team on held-out GSM8K, train it, score it again.

    The budget on top of the preset (flexmarl/bench/learning_bench.py BUDGET, docs/performance.md
    "Learning"): 12 steps of 4 problems x 8 answers, lr 1e-5, solver temperature 0.7, trained on the GSM8K
    train problems with at most one calculation, which the base model solves sometimes: a GRPO group
    teaches only when its rewards differ. Scored greedily on the first --n-eval GSM8K test problems, with
    the config's max_new_tokens; without the GSM8K files, on reasoning-gym gsm_symbolic under another seed.
    """
    from flexmarl.bench.learning_bench import GSM8K_DIR, N_EVAL, plan_learning, run_learning_bench
    from flexmarl.config import ConfigError
    from flows.prefect_server import PrefectAPIError, prefect_api

    try:
        plan = plan_learning(out, preset=preset, steps=steps, n_eval=n_eval or N_EVAL, overrides=set_ or [],
                             data_dir=data_dir or GSM8K_DIR)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))

    try:
        with prefect_api() as url:
            console.print(f"Prefect API: {url}")
            report = run_learning_bench(plan, out, train=train_with_flow, log=console.print)
    except PrefectAPIError as exc:
        fail(str(exc))
    agreement = report["verifier_agreement"]
    console.print(
        f"solver accuracy on {report['n_eval']} held-out problems: base {report['base_accuracy']:.3f}, "
        f"trained {report['trained_accuracy']:.3f} after {report['steps']} steps "
        f"(+{report['gained']} / -{report['lost']} problems); verifier agreement: base {agreement['base']:.3f}, "
        f"trained {agreement['trained']:.3f}; {report['wall_s']:.0f} s"
    )
    console.print(f"report: {out / 'learning.json'}")
