"""`flexmarl store ...`: inspect a run's experience store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli_output import console, fail

store_app = typer.Typer(help="Inspect a run's experience store.", no_args_is_help=True)


def store_root(run_dir: Path) -> Path:
    """A run directory's store, or the path itself when it is a store root."""
    root = run_dir / "store" if (run_dir / "store").is_dir() else run_dir
    if not root.is_dir():
        fail(f"{run_dir} is neither a run directory nor a store")
    return root


@store_app.command("inspect")
def store_inspect(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (or a store root).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Each table's Delta version, rows and files; rows per agent and policy version."""
    from storage.store import ExperienceStore, StoreError

    try:
        info = ExperienceStore(store_root(run_dir)).describe()
    except StoreError as exc:
        fail(str(exc))
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    tables = Table(title=f"store {info['root']}")
    for col in ("table", "version", "rows", "files", "bytes"):
        tables.add_column(col)
    for name, t in info["tables"].items():
        tables.add_row(name, *(str(t.get(k, t.get("error", ""))) for k in ("version", "rows", "files", "bytes")))
    console.print(tables)
    agents = Table(title="samples per agent and policy version")
    for col in ("agent", "rows", "by version"):
        agents.add_column(col)
    for agent, a in info["agents"].items():
        agents.add_row(agent, str(a["rows"]), ", ".join(f"v{v}: {n}" for v, n in a["by_version"].items()))
    console.print(agents)
