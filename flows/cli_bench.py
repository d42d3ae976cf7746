"""`flexmarl bench ...`: benchmarks that write JSON reports (speed is measured here, never asserted in tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

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
    import json

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
