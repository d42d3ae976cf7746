"""The `flexmarl` command line: local runs, config validation, reports, exports and store inspection."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flexmarl.config import PRESETS
from flows.cli_bench import bench_app
from flows.cli_output import console, err_console, fail, print_error
from flows.cli_report import export_command, report_command
from flows.cli_sim import simulate
from flows.cli_store import store_app

app = typer.Typer(help="FlexMARL: train teams of LLM agents with reinforcement learning.", no_args_is_help=True)
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.command()(simulate)


def user_errors() -> tuple[type[BaseException], ...]:
    """The project's own errors: each carries a one-line message naming the problem and the fix, so the CLI
    prints it (exit 2) instead of a traceback."""
    from flexmarl.cluster.local import ClusterError
    from flexmarl.cluster.worker_python import WorkerPythonError
    from flexmarl.config import ConfigError
    from flexmarl.models.loading import ModelError
    from flexmarl.preflight import RunLocationError
    from flexmarl.run.plan import RunDirError
    from flexmarl.run_lock import RunLockError
    from flexmarl.run_start import ResumeRefused
    from flexmarl.tracking.tracker import TrackingError
    from flexmarl.training.snapshots import SnapshotError
    from flexmarl.workloads.datasets import DataError
    from flows.prefect_server import PrefectAPIError
    from storage.store import StoreError

    return (ConfigError, ModelError, DataError, RunLocationError, RunDirError, RunLockError, ResumeRefused,
            ClusterError, WorkerPythonError, StoreError, PrefectAPIError, SnapshotError, TrackingError)


def stop_on_sigterm(run_dir: Path) -> None:
    """SIGTERM ends the run like Ctrl-C: the finally blocks stop the run's Prefect server and cluster (Python's
    default would exit without running them)."""

    def handler(signum, frame):  # noqa: ARG001
        err_console.print(f"stopped by SIGTERM; continue the run with `flexmarl train --resume {run_dir}`",
                          highlight=False, soft_wrap=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def stop_when_the_server_exits(run_dir: Path) -> Callable[[str, int], None]:
    """What the run does when the Prefect server it started is killed: say so, then end at once, as a kill of the
    driver would (its workers end with it; a resume continues from the store). Unwinding through Prefect
    instead waits out its client's retries against the dead server: over four minutes."""
    from flows.run_failures import lost_api_line

    def stop(url: str, returncode: int) -> None:
        cause = (f"its server was killed by {signal.Signals(-returncode).name}" if returncode < 0
                 else f"its server exited with code {returncode}")
        print_error(lost_api_line(url, run_dir, cause))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return stop


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
    from flexmarl.config import run_overrides
    from flexmarl.run.plan import RunRequest, locked_plan

    if config is not None and preset is not None:
        fail("give a config file or --preset, not both")
    if resume is not None and (config is not None or preset is not None or run_dir is not None):
        fail("--resume continues a run with its own config and directory: drop the config, --preset and --run-dir")
    run_dir = resume or run_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    stop_on_sigterm(run_dir)
    errors = user_errors()
    # the flow's own request, so that the flow takes this plan as it is (plan.locked_plan is re-entrant)
    request = RunRequest(str(run_dir), config=str(config) if config else None, preset=preset,
                         overrides=tuple(run_overrides(set_, dask_address)), resume=resume is not None)
    try:
        # everything is checked here, under the lock, before anything is written or started
        with locked_plan(request) as plan:
            from flexmarl.estimate import describe_estimate

            console.print(f"run directory {run_dir}; {describe_estimate(plan.cfg)}", highlight=False)

            from flows.prefect_server import prefect_api
            from flows.run_failures import explain_failure
            from flows.train import train_run

            with prefect_api(on_server_exit=stop_when_the_server_exits(run_dir)) as url:
                console.print(f"Prefect API: {url}")
                try:
                    report = train_run(
                        preset=preset, config=str(config) if config else None, overrides=set_ or [],
                        run_dir=None if resume else str(run_dir), dask_address=dask_address,
                        resume=str(resume) if resume else None,
                    )
                except Exception as exc:
                    if isinstance(exc, errors) or (line := explain_failure(exc, url, run_dir)) is None:
                        raise
                    fail(line, code=1)  # not the user's mistake: no traceback, and not exit 2
    except errors as exc:
        fail(str(exc))
    table = Table(title=f"run {report['run_id']} ({report['wall_s']:.1f} s)")
    for col in ("agent", "version", "updates", "generated", "trained", "tokens", "reward by step"):
        table.add_column(col)
    for agent, a in report["agents"].items():
        rewards = " ".join("-" if r is None else f"{r:.2f}" for r in a["mean_reward"])
        table.add_row(agent, str(a["policy_version"]), str(a["updates"]), str(a["samples_generated"]),
                      str(a["samples_trained"]), str(a["tokens_generated"]), rewards)
    console.print(table)
    from flexmarl.report.summary import learned_lines

    for line in learned_lines(report):
        console.print(f"learned: {line}", highlight=False)
    for line in failure_lines(report):
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    from flexmarl.report.write import write_report
    from flexmarl.run.directory import RunDirectory

    done = Path(report["run_dir"])
    console.print(f"report: {done / 'report.json'}", highlight=False)
    try:  # the run is done and saved: a picture that cannot be drawn is a warning, not a failed run
        files = write_report(RunDirectory(done), done / "report")
    except Exception as exc:  # noqa: BLE001 - any failure to draw leaves the finished run as it is
        console.print(f"[yellow]warning:[/] no pictures ({type(exc).__name__}: {exc}); try `flexmarl report {done}`",
                      highlight=False)
        return
    console.print(f"pages: {files.html}; reward picture: {files.pictures['rewards of all agents']}", highlight=False)


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
def validate(
    config: Annotated[Optional[Path], typer.Argument(help="Config YAML file (default: the preset).")] = None,
    preset: Annotated[Optional[str], typer.Option(help=f"Shipped config: {', '.join(PRESETS)}.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override: dotted.key=value.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Also check that this run directory can be written.")] = None,
) -> None:
    """Check a config and what it names (models, data), as `flexmarl train` does before it starts anything:
    exit 0 when valid, 2 with the problem named otherwise."""
    from flexmarl.config import config_summary, load_config
    from flexmarl.preflight import check_inputs, check_run_location

    if config is not None and preset is not None:
        fail("give a config file or --preset, not both")
    try:
        cfg = load_config(config, preset=None if config else (preset or "default"), overrides=set_ or [])
        if run_dir is not None:
            check_run_location(cfg, run_dir)
        check_inputs(cfg)
    except user_errors() as exc:
        fail(str(exc))
    order = " -> ".join(cfg.graph.order())
    console.print(f"[green]valid[/]: {len(cfg.agents)} agents, graph order {order}; {config_summary(cfg)}",
                  soft_wrap=True)


@app.command()
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with checkpoints.")],
    n: Annotated[int, typer.Option(min=1, help="Held-out problems.")] = 500,
    data_path: Annotated[Optional[Path], typer.Option(
        help="A JSONL file of held-out problems (default: the run's dataset under another seed).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Problems per greedy generation batch.")] = 32,
    dask_address: Annotated[Optional[str], typer.Option(help="Existing Dask scheduler address.")] = None,
) -> None:
    """Run the trained team on held-out problems through its own graph, beside its base team: the team's
    accuracy, each agent's, each judge's verdicts, calls per problem, with 95% Wilson intervals
    (RUN_DIR/evaluation.json)."""
    from flexmarl.evaluate import plan_evaluation
    from flexmarl.run.layout import EVALUATION_FILE

    try:  # every input is checked here, before a server or a cluster starts
        plan_evaluation(run_dir, n, data_path=data_path)
    except user_errors() as exc:
        fail(str(exc))
    from flows.evaluate import evaluate_run, evaluation_rows
    from flows.prefect_server import prefect_api

    try:
        with prefect_api() as url:
            console.print(f"Prefect API: {url}")
            report = evaluate_run(str(run_dir), n=n, data_path=str(data_path) if data_path else None,
                                  batch_size=batch_size, dask_address=dask_address)
    except user_errors() as exc:
        fail(str(exc))
    table = Table(title=f"{run_dir} on {report['n']} held-out problems (greedy; 95% Wilson intervals)")
    for col in ("", "base", "trained"):
        table.add_column(col)
    for row in evaluation_rows(report):
        table.add_row(row["what"], row["base"], row["trained"])
    console.print(table)
    console.print(f"report: {run_dir / EVALUATION_FILE}", highlight=False)


app.command("report")(report_command)
app.command("export")(export_command)


if __name__ == "__main__":
    app()
