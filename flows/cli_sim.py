"""`flexmarl simulate`: the cluster simulator (the runtime's policies on a simulated clock and a cost model)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flows.cli_output import console, fail


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def simulate(
    out: Annotated[Path, typer.Option(help="Output directory: sim.json and timelines (or sweep_*.json/png).")],
    preset: Annotated[Optional[str], typer.Option(
        help="Simulator preset: paper-ma, paper-ca, scale-15x14b, scale-3x32b-7x14b, scale-5x32b, or a YAML file.",
    )] = None,
    modes: Annotated[Optional[str], typer.Option(
        help="Comma-separated: sync,flexmarl,no-lb,no-pipeline,stale1 (the default), whole-batches, "
             "flexmarl-group, sync-group, sync-disagg; a sweep's default is sync,flexmarl.",
    )] = None,
    steps: Annotated[Optional[int], typer.Option(min=1, help="Steps per mode (default: the preset's).")] = None,
    sweep: Annotated[Optional[str], typer.Option(
        help="Sweep 'agents' (2 to 64) or 'devices' (64 to 8,192) from scale-15x14b instead of one preset.",
    )] = None,
    calibrate: Annotated[bool, typer.Option(
        help="Measure the tiny models' costs on this machine, write a calibrated preset of the fan_out benchmark "
             "and predict `flexmarl bench pipeline`'s wall times.",
    )] = False,
    bench: Annotated[Optional[Path], typer.Option(
        help="With --calibrate: a bench.json of `flexmarl bench pipeline` to compare the prediction with.",
    )] = None,
) -> None:
    """Simulate the pipeline's schedules at cluster scale (no GPU needed): step time, utilisation, tokens/s."""
    from flexmarl.sim.costmodel import PresetError, load_preset
    from flexmarl.sim.experiments import run_preset, run_sweep

    default = "sync,flexmarl" if sweep is not None else "sync,flexmarl,no-lb,no-pipeline,stale1"
    mode_list = [m.strip() for m in (modes or default).split(",") if m.strip()]
    if [preset is not None, sweep is not None, calibrate].count(True) > 1:
        fail("give one of --preset, --sweep or --calibrate")
    try:
        if calibrate:
            _calibrate(out, mode_list, steps, bench)
        elif sweep is not None:
            report = run_sweep(sweep, modes=mode_list, steps=steps or 5, out_dir=out, log=console.print)
            stem = out / f"sweep_{report['sweep']}"
            console.print(f"wrote {stem}.json and {stem}.png")
        elif preset is None:
            fail("give --preset (paper-ma, paper-ca, scale-15x14b, scale-3x32b-7x14b, scale-5x32b or a YAML file), "
                 "--sweep agents|devices, or --calibrate")
        else:
            report = run_preset(load_preset(preset), mode_list, steps=steps, out_dir=out, log=console.print)
            _print_report(report)
            console.print(f"wrote {out / 'sim.json'} ({report['sim_wall_s']:.1f} s of simulation)")
    except (PresetError, ValueError) as exc:
        fail(str(exc))


def _print_report(report: dict) -> None:
    table = Table(title=f"{report['preset']}: {report['agents']} agents on {report['devices']} devices")
    for col in ("mode", "s/step", "vs sync", "utilisation", "tokens/s", "slot moves"):
        table.add_column(col)
    for mode, r in report["modes"].items():
        table.add_row(mode, f"{r['step_s']:.1f}", _ratio(report["speedup_vs_sync"].get(mode)),
                      f"{r['utilization']:.0%}", f"{r['tokens_per_s']:.0f}", str(r["slot_moves"]))
    console.print(table)
    paper = report["paper"] or {}
    ratios = Table(title="ratios (seconds per step)")
    for col in ("ratio", "paper", "ours"):
        ratios.add_column(col)
    for key, ours in report["ours"].items():
        ratios.add_row(key, _ratio(paper.get(key)), _ratio(ours))
    console.print(ratios)


def _calibrate(out: Path, modes: list[str], steps: int | None, bench: Path | None) -> None:
    from flexmarl.sim.calibrate import calibrate_fan_out

    report = calibrate_fan_out(out, modes=modes, steps=steps or 3, bench_json=bench, log=console.print)
    table = Table(title=f"prediction for `flexmarl bench pipeline` ({report['steps']} steps, this machine)")
    for col in ("mode", "predicted wall s", "measured wall s", "error"):
        table.add_column(col)
    for mode, r in report["modes"].items():
        measured = r.get("measured_wall_s")
        table.add_row(mode, f"{r['predicted_wall_s']:.1f}", "-" if measured is None else f"{measured:.1f}",
                      "-" if measured is None else f"{r['error']:+.0%}")
    console.print(table)
    console.print(f"wrote {out / 'calibration.json'} and {out / 'calibrated-fan_out.yaml'}")
