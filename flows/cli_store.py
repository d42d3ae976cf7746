"""`flexmarl store ...`: inspect, verify and export a run's experience store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from flows.cli_output import console, fail

store_app = typer.Typer(help="Inspect, verify and export a run's experience store.", no_args_is_help=True)

RunDir = Annotated[Path, typer.Argument(help="Run directory (or a store root).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
SHOWN_IDS = 10  # ids per violation in the text output; --json lists them all


def store_root(run_dir: Path) -> Path:
    """A run directory's store, or the path itself when it is a store root."""
    root = run_dir / "store" if (run_dir / "store").is_dir() else run_dir
    if not root.is_dir():
        fail(f"{run_dir} is neither a run directory nor a store")
    return root


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


@store_app.command("inspect")
def store_inspect(run_dir: RunDir, as_json: AsJson = False) -> None:
    """Each table's Delta version, rows, data files and bytes; rows per agent and policy version."""
    from storage.store import ExperienceStore, StoreError

    try:
        info = ExperienceStore(store_root(run_dir)).describe()
    except StoreError as exc:
        fail(str(exc))
    if as_json:
        print_json(info)
        return
    tables = Table(title=f"store {info['root']}")
    for col in ("table", "version", "rows", "files", "bytes"):
        tables.add_column(col)
    for name, t in info["tables"].items():
        if "error" in t:
            tables.add_row(name, f"[red]unreadable: {t['error']}[/]", "", "", "")
        else:
            tables.add_row(name, *(str(t[k]) for k in ("version", "rows", "files", "bytes")))
    console.print(tables)
    agents = Table(title="samples per agent and policy version")
    for col in ("agent", "rows", "by version"):
        agents.add_column(col)
    for agent, a in info["agents"].items():
        if "error" in a:
            agents.add_row(agent, "[red]unreadable[/]", "")
        else:
            agents.add_row(agent, str(a["rows"]), ", ".join(f"v{v}: {n}" for v, n in a["by_version"].items()))
    console.print(agents)


@store_app.command("verify")
def store_verify(
    run_dir: RunDir,
    as_json: AsJson = False,
    max_staleness: Annotated[int, typer.Option(min=0, help="Versions older than v-1 an update to v may consume.")] = 0,
) -> None:
    """Check the store's invariants: exit 0 when it is consistent, 1 listing every violation."""
    from storage.store import ExperienceStore, StoreError
    from storage.verify import verify_store

    store = ExperienceStore(store_root(run_dir))
    try:
        violations = verify_store(store, max_staleness=max_staleness)
    except StoreError as exc:
        fail(str(exc))
    if as_json:
        print_json({"root": store.root, "ok": not violations, "violations": [v.to_dict() for v in violations]})
    elif not violations:
        console.print(f"[green]ok[/]: no violations in {len(store.tables())} tables under {store.root}")
    else:
        table = Table(title=f"{len(violations)} violation(s) in {store.root}")
        for col in ("check", "table", "ids", "detail"):
            table.add_column(col, overflow="fold")
        for v in violations:
            ids = ", ".join(v.ids[:SHOWN_IDS]) + (f", ... ({len(v.ids)} in all)" if len(v.ids) > SHOWN_IDS else "")
            table.add_row(v.check, v.table, ids, v.detail)
        console.print(table)
    if violations:
        raise typer.Exit(code=1)


@store_app.command("export")
def store_export(
    run_dir: RunDir,
    agent: Annotated[str, typer.Option(help="Whose samples.")],
    out: Annotated[Path, typer.Option(help="File to write (replaced if it exists).")],
    format: Annotated[str, typer.Option("--format", help="parquet or jsonl.")] = "parquet",
    version: Annotated[Optional[int], typer.Option(help="Only samples of this policy version.")] = None,
) -> None:
    """Write an agent's samples, in sample_id order, to a Parquet or JSON Lines file."""
    from storage.export import export_samples
    from storage.store import ExperienceStore, StoreError

    if format not in ("parquet", "jsonl"):
        fail(f"--format must be parquet or jsonl, got {format!r}")
    store = ExperienceStore(store_root(run_dir))
    if agent not in store.agents():
        fail(f"no agent {agent!r} in {store.root}; agents: {', '.join(store.agents()) or 'none'}")
    try:
        result = export_samples(store, agent, out, format=format, policy_version=version)
    except (StoreError, OSError) as exc:
        fail(str(exc))
    which = "" if version is None else f" of policy version {version}"
    console.print(f"wrote {result.rows} {agent} samples{which} (Delta version {result.version}) to {out}")
