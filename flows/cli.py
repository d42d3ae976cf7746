"""The `flexmarl` command line: local runs, config validation and store inspection."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flows.cli_bench import bench_app
from flows.cli_output import console, fail
from flows.cli_store import store_app

app = typer.Typer(help="FlexMARL: train teams of LLM agents with reinforcement learning.", no_args_is_help=True)
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(help="Config YAML file (default: the preset).")] = None,
    preset: Annotated[Optional[str], typer.Option(help="Shipped config: default or tiny.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Run directory (default runs/<time>).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
    dask_address: Annotated[Optional[str], typer.Option(help="Existing Dask scheduler address.")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        help="Continue the run in this run directory (crashed or stopped) from its store and training state.",
    )] = None,
) -> None:
    """Train the agents of a MEG (a Prefect flow run on a Dask cluster)."""
    from flexmarl.config import ConfigError, load_config
    from flexmarl.orchestrator.runtime import CONFIG_FILE, resume_config

    if config is not None and preset is not None:
        fail("give a config file or --preset, not both")
    if resume is not None and (config is not None or preset is not None or run_dir is not None):
        fail("--resume continues a run with its own config and directory: drop the config, --preset and --run-dir")
    if run_dir is not None and (run_dir / CONFIG_FILE).exists():
        fail(f"{run_dir} already holds a run: continue it with --resume {run_dir}, or choose another --run-dir")
    try:  # validate before starting any server or cluster
        if resume is not None:
            resume_config(resume, [*(set_ or []), *([f"cluster.address={dask_address}"] if dask_address else [])])
        else:
            load_config(config, preset=None if config else (preset or "default"), overrides=set_ or [])
    except ConfigError as exc:
        fail(str(exc))

    from flows.prefect_server import PrefectAPIError, prefect_api
    from flows.train import train_run

    try:
        with prefect_api() as url:
            console.print(f"Prefect API: {url}")
            report = train_run(
                preset=preset, config=str(config) if config else None, overrides=set_ or [],
                run_dir=str(run_dir) if run_dir else None, dask_address=dask_address,
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
    console.print(f"report: {Path(report['run_dir']) / 'report.json'}")


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


if __name__ == "__main__":
    app()
