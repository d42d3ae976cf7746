"""`flexmarl store ...`: inspect, verify, query and export a run's experience store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli_output import console, fail

store_app = typer.Typer(help="Inspect, verify, query and export a run's experience store.", no_args_is_help=True)

RunDir = Annotated[Path, typer.Argument(help="Run directory (or a store root).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
SHOWN_IDS = 10  # ids per violation in the text output; --json lists them all


def store_root(run_dir: Path) -> Path:
    """A run directory's store, or the path itself when it is a store root."""
    root = run_dir / "store" if (run_dir / "store").is_dir() else run_dir
    if not root.is_dir():
        fail(f"{run_dir} is neither a run directory nor a store")
    return root


def run_staleness_bound(run_dir: Path) -> int:
    """The staleness bound of the run in ``run_dir`` (its config.yaml), or 0 for a bare store."""
    from flexmarl.config import ConfigError
    from flexmarl.run.layout import CONFIG_FILE
    from flexmarl.run.plan import resume_config
    from flexmarl.run_start import max_staleness

    if not (run_dir / CONFIG_FILE).is_file():
        return 0
    try:
        return max_staleness(resume_config(run_dir))
    except ConfigError as exc:
        fail(f"{exc}; or pass --max-staleness to verify the store without the run's config")


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
    max_staleness: Annotated[Optional[int], typer.Option(
        min=0, help="Versions older than v-1 an update to v may consume (default: the run's own bound, else 0).",
    )] = None,
) -> None:
    """Check the store's invariants: exit 0 when it is consistent, 1 listing every violation."""
    from storage.store import ExperienceStore, StoreError
    from storage.verify import verify_store

    store = ExperienceStore(store_root(run_dir))
    if max_staleness is None:
        max_staleness = run_staleness_bound(run_dir)
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


@store_app.command("query")
def store_query(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (its config names each agent's tokenizer).")],
    agent: Annotated[Optional[str], typer.Option(help="Whose samples.")] = None,
    version: Annotated[Optional[int], typer.Option(help="Only samples of this policy version.")] = None,
    where: Annotated[Optional[str], typer.Option(
        help="SQL condition, e.g. \"reward > 0 and node = 'solver'\".")] = None,
    limit: Annotated[int, typer.Option(min=0, help="At most this many samples; 0 for all.")] = 20,
    format: Annotated[str, typer.Option("--format", help="table or jsonl.")] = "table",
    episode: Annotated[Optional[str], typer.Option(help="Show one whole episode, every agent in graph order.")] = None,
) -> None:
    """Samples with their prompt and response decoded to text: an agent's (filtered), or one episode's."""
    from flexmarl.report.transcripts import decode_samples
    from flexmarl.run.directory import RunDirectory, RunDirectoryError
    from storage.query import episode_record, episode_samples, query_samples
    from storage.store import StoreError
    from storage.where import FilterError

    if format not in ("table", "jsonl"):
        fail(f"--format must be table or jsonl, got {format!r}")
    if (agent is None) == (episode is None):
        fail("give --agent A (with optional --version, --where, --limit) or --episode ID, exactly one")
    if episode is not None and (version is not None or where is not None):
        fail("--version and --where select an agent's samples; --episode shows the whole episode")
    try:
        run = RunDirectory(run_dir)
        if episode is not None:
            rows = episode_samples(run.store, episode)
            record = episode_record(run.store, episode)
        else:
            run.check_agent(agent)
            rows = query_samples(run.store, agent, where=where, policy_version=version, limit=limit or None)
            record = None
        tokenizers = {a: run.tokenizer(a) for a in set(rows["agent"].to_pylist())}
    except (RunDirectoryError, StoreError, FilterError) as exc:
        fail(str(exc))
    samples = decode_samples(rows, tokenizers)
    if format == "jsonl":
        for item in samples:
            sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
        return
    if record is not None:
        rewards = ", ".join(f"{k} {v:.2f}" for k, v in record["rewards"]) or "none"
        console.print(f"episode [bold]{episode}[/]: step {record['step']}, outcome {record['outcome']}, "
                      f"rewards: {rewards}", highlight=False)
        console.print(f"task: {json.dumps(record['task'].get('fields', record['task']), ensure_ascii=False)}",
                      markup=False, highlight=False)
    what = f"episode {episode}" if episode else f"{agent} samples" + (f" of v{version}" if version is not None else "")
    table = Table(title=f"{len(samples)} {what}" + (f" where {where}" if where else ""), show_lines=True,
                  expand=True)
    # the texts get most of the width; ids and numbers fold when the terminal is narrow
    for col, ratio in (("sample", 2), ("node", 1), ("v", None), ("reward", None), ("parsed", 1), ("prompt", 4),
                       ("response", 4)):
        table.add_column(col, overflow="fold", ratio=ratio)
    for s in samples:
        reward = "-" if s["reward"] is None else f"{s['reward']:.3g}"
        table.add_row(s["sample_id"], s["node"], str(s["policy_version"]), reward, str(s["parsed"]),
                      escape(s["prompt"]), escape(s["response"]) + f"\n[dim]({s['response_tokens']} tokens, "
                      f"{s['finish_reason']})[/]")
    console.print(table)
