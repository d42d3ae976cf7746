"""`flexmarl bench ...`: benchmarks that write JSON reports (speed is measured here, never asserted in tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli_output import console

bench_app = typer.Typer(help="Run a benchmark and write its JSON report.", no_args_is_help=True)


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
