"""The `flexmarl` command line: local runs, config validation, reports, exports and store inspection."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flexmarl.config import PRESETS
from flows.cli_bench import bench_app
from flows.cli_output import console, fail
from flows.cli_report import export_command, report_command
from flows.cli_sim import simulate
from flows.cli_store import store_app

app = typer.Typer(help="FlexMARL: train teams of LLM agents with reinforcement learning.", no_args_is_help=True)
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.command()(simulate)


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(help="Config YAML file (default: the preset).")] = None,
    preset: Annotated[Optional[str], typer.Option(help=f"Shipped config: {', '.join(PRESETS)}.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Run directory (default runs/<time>).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
    dask_address: Annotated[Optional[str], typer.Option(help="Existing Dask scheduler address.")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        help="Continue the run in this run directory (crashed or stopped) from its store and training state.",
    )] = None,
) -> None:
    """Train the agents of a MEG (a Prefect flow run on a Dask cluster)."""
    from flexmarl.config import ConfigError, load_config
    from flexmarl.models.loading import ModelError
    from flexmarl.orchestrator.runtime import (
        RunSetupError,
        check_inputs,
        check_new_run_dir,
        check_run_paths,
        resume_config,
    )
    from flexmarl.workloads.datasets import DataError

    if config is not None and preset is not None:
        fail("give a config file or --preset, not both")
    if resume is not None and (config is not None or preset is not None or run_dir is not None):
        fail("--resume continues a run with its own config and directory: drop the config, --preset and --run-dir")
    run_dir = resume or run_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    try:  # check the inputs, and that the run can write its results, before starting any server or cluster
        overrides = [*(set_ or []), *([f"cluster.address={dask_address}"] if dask_address else [])]
        if resume is not None:
            cfg = resume_config(resume, overrides)
        else:
            check_new_run_dir(run_dir)
            cfg = load_config(config, preset=None if config else (preset or "default"), overrides=overrides)
        check_run_paths(cfg, run_dir)
        check_inputs(cfg)
    except (ConfigError, RunSetupError, ModelError, DataError) as exc:
        fail(str(exc))
    from flexmarl.estimate import describe_estimate

    console.print(f"run directory {run_dir}; {describe_estimate(cfg)}", highlight=False)

    from flows.prefect_server import PrefectAPIError, prefect_api
    from flows.train import train_run

    try:
        with prefect_api() as url:
            console.print(f"Prefect API: {url}")
            report = train_run(
                preset=preset, config=str(config) if config else None, overrides=set_ or [],
                run_dir=None if resume else str(run_dir), dask_address=dask_address,
                resume=str(resume) if resume else None,
            )
    except PrefectAPIError as exc:
        fail(str(exc))
    table = Table(title=f"run {report['run_id']} ({report['wall_s']:.1f} s)")
    for col in ("agent", "version", "updates", "generated", "trained", "tokens", "reward by step"):
        table.add_column(col)
    for agent, a in report["agents"].items():
        rewards = " ".join("-" if r is None else f"{r:.2f}" for r in a["mean_reward"])
        table.add_row(agent, str(a["policy_version"]), str(a["updates"]), str(a["samples_generated"]),
                      str(a["samples_trained"]), str(a["tokens_generated"]), rewards)
    console.print(table)
    for line in failure_lines(report):
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    from flexmarl.report.write import write_report
    from flexmarl.run_directory import RunDirectory

    done = Path(report["run_dir"])
    files = write_report(RunDirectory(done), done / "report")
    console.print(f"report: {done / 'report.json'}; pages: {files.html}", highlight=False)
    console.print(f"reward picture: {files.pictures['rewards of all agents']}", highlight=False)


def failure_lines(report: dict) -> list[str]:
    """What went wrong without stopping the run: failed episodes, unparsed outputs, skipped updates."""
    lines = []
    if report.get("episodes_failed"):
        lines.append(f"{report['episodes_failed']} episode(s) failed because a reward function raised; their "
                     "samples were not trained on (see the episodes table's 'error' column)")
    for agent, a in report["agents"].items():
        if a.get("samples_unparsed"):
            lines.append(f"{agent}: {a['samples_unparsed']} of {a['samples_generated']} outputs did not parse "
                         f"(rewarded 0 by the built-in rewards); check agents.{agent}.parser and its prompt")
        if a.get("skipped_updates"):
            lines.append(f"{agent}: {a['skipped_updates']} update(s) skipped because the loss was not finite "
                         "(weights untouched); lower training.lr or check the rewards")
    return lines


@app.command()
def validate(config: Annotated[Path, typer.Argument(help="Config YAML file.")]) -> None:
    """Check a config: exit 0 when valid, 2 with the problems named otherwise."""
    from flexmarl.config import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        fail(str(exc))
    order = " -> ".join(cfg.graph.order())
    console.print(f"[green]valid[/]: {len(cfg.agents)} agents, graph order {order}")


app.command("report")(report_command)
app.command("export")(export_command)


if __name__ == "__main__":
    app()
