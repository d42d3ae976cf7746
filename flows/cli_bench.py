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


@bench_app.command("chaos")
def chaos(
    out: Annotated[Path, typer.Option(help="Output directory for chaos.json and the runs' directories.")],
    preset: Annotated[str, typer.Option(help="Workload preset.")] = "tiny",
    faults: Annotated[int, typer.Option(min=1, help="Faults to inject, one run each.")] = 6,
    seed: Annotated[int, typer.Option(help="Draws the kinds of fault and where they strike.")] = 0,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
) -> None:
    """Inject real faults (killed and frozen workers, a killed driver) into tiny runs; check none lost a sample."""
    from flexmarl.bench.chaos_bench import bench_chaos
    from flexmarl.config import ConfigError

    try:
        report = bench_chaos(out_dir=out, preset=preset, faults=faults, seed=seed, overrides=set_ or [],
                             log=console.print)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    table = Table(title=f"chaos: {report['faults_injected']} faults, {report['runs_completed']} runs completed")
    for col in ("fault", "at", "recovered s", "lost", "duplicated", "skipped", "max weight diff", "verify"):
        table.add_column(col)
    for r in report["runs"]:
        recovered = "-" if r["recovered_s"] is None else f"{r['recovered_s']:.2f}"
        table.add_row(r["kind"], r["at"], recovered, str(r["samples_lost"]),
                      str(r["samples_duplicated"] + r["samples_unplanned"]), str(r["prompts_skipped"]),
                      f"{r['max_weight_diff']:.1e}", str(r["verify_violations"] or "ok"))
    console.print(table)
    console.print(f"weights_match_uninterrupted: {report['weights_match_uninterrupted']}; report: {out / 'chaos.json'}")
