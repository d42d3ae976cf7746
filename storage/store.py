"""The MEG Store: one Delta table per agent, an episodes table and an updates table under one root.

Every append is idempotent: the caller names the logical writer (``app_id``) and a sequence number
(``seq``) that only grows; the store records both in the same Delta commit (``Transaction``) and skips a
commit whose sequence number was already recorded. A retried or re-run task therefore never writes a row
twice. Readers pin a Delta version, so every stage sees one consistent snapshot.

Example:
    >>> store = ExperienceStore("runs/demo/store")
    >>> store.create(["solver", "verifier"])
    >>> store.append_samples("solver", rows, app_id="rollout:solver", seq=1)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from storage.schema import EPISODE_SCHEMA, SAMPLE_SCHEMA, UPDATE_SCHEMA

SAMPLES_DIR = "samples"
EPISODES = "episodes"
UPDATES = "updates"


class StoreError(RuntimeError):
    """A store operation failed; the message names the table and what to do."""


@dataclass(frozen=True)
class Commit:
    """Result of an idempotent append."""

    table: str
    version: int  # Delta version that holds the rows
    skipped: bool  # True when this (app_id, seq) was already committed


def now() -> datetime:
    return datetime.now(UTC)


class ExperienceStore:
    """Versioned, exactly-once experience store on Delta Lake.

    Args:
        root: a local directory or any URI deltalake supports (``s3://...``).
        storage_options: passed to deltalake for object stores.
        max_commit_attempts: our own retries (with jittered backoff) on top of deltalake's, for commit
            conflicts between concurrent writers.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        storage_options: dict[str, str] | None = None,
        max_commit_attempts: int = 10,
    ) -> None:
        root = str(root)
        self.root = root if "://" in root else os.path.abspath(root)
        self.storage_options = storage_options
        self.max_commit_attempts = max_commit_attempts

    # ---------------------------------------------------------------- table names and creation

    def table_uri(self, table: str) -> str:
        """URI of a table: ``"episodes"``, ``"updates"`` or ``"samples/<agent>"``."""
        return f"{self.root}/{table}"

    @staticmethod
    def samples_table(agent: str) -> str:
        return f"{SAMPLES_DIR}/{agent}"

    def create(self, agents: Iterable[str]) -> None:
        """Create any missing table (empty, with its schema). Safe to call on an existing store."""
        wanted = {EPISODES: EPISODE_SCHEMA, UPDATES: UPDATE_SCHEMA}
        wanted.update({self.samples_table(a): SAMPLE_SCHEMA for a in agents})
        for table, schema in wanted.items():
            write_deltalake(
                self.table_uri(table),
                schema.empty_table(),
                mode="ignore",  # leaves an existing table untouched
                storage_options=self.storage_options,
            )

    def agents(self) -> list[str]:
        """Agents that have a sample table, sorted."""
        fs, path = pafs.FileSystem.from_uri(self.table_uri(SAMPLES_DIR))
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def tables(self) -> list[str]:
        return [EPISODES, UPDATES] + [self.samples_table(a) for a in self.agents()]

    def open(self, table: str, *, version: int | None = None) -> DeltaTable:
        """Open a table, pinned to ``version`` when given (a consistent snapshot)."""
        try:
            return DeltaTable(self.table_uri(table), version=version, storage_options=self.storage_options)
        except TableNotFoundError as exc:
            raise StoreError(
                f"no Delta table {table!r} under {self.root}: is this a FlexMARL store "
                "(a run directory's 'store/' folder)?"
            ) from exc

    def version(self, table: str) -> int:
        return self.open(table).version()

    # ---------------------------------------------------------------- writes

    def append(self, table: str, data: pa.Table, *, app_id: str, seq: int, schema: pa.Schema) -> Commit:
        """Append ``data`` once per ``(app_id, seq)``.

        Raises:
            StoreError: the rows do not match the table's schema, or commits kept conflicting.
        """
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        try:
            data = data.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"rows for {table!r} do not match its schema: {exc}") from exc

        for attempt in Retrying(
            retry=retry_if_exception_type(CommitFailedError),
            wait=wait_random_exponential(multiplier=0.02, max=1.0),
            stop=stop_after_attempt(self.max_commit_attempts),
            reraise=True,
        ):
            with attempt:
                dt = self.open(table)
                done = dt.transaction_version(app_id)
                if done is not None and done >= seq:
                    return Commit(table, dt.version(), skipped=True)
                write_deltalake(
                    dt,
                    data,
                    mode="append",
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(app_id, seq)],
                        custom_metadata={"flexmarl.app_id": app_id, "flexmarl.seq": str(seq)},
                    ),
                    storage_options=self.storage_options,
                )
                dt.update_incremental()
                return Commit(table, dt.version(), skipped=False)
        raise AssertionError("unreachable")  # pragma: no cover

    def append_samples(self, agent: str, data: pa.Table, *, app_id: str, seq: int) -> Commit:
        return self.append(self.samples_table(agent), data, app_id=app_id, seq=seq, schema=SAMPLE_SCHEMA)

    def append_episodes(self, data: pa.Table, *, app_id: str, seq: int) -> Commit:
        return self.append(EPISODES, data, app_id=app_id, seq=seq, schema=EPISODE_SCHEMA)

    def record_update(
        self,
        agent: str,
        policy_version: int,
        consumed_ids: Sequence[str],
        *,
        samples_version: int,
        num_tokens: int,
        checkpoint_uri: str | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Commit:
        """Record that ``agent``'s update to ``policy_version`` consumed ``consumed_ids``.

        The consumption record and the version bump are one row in one commit, and the commit is keyed by
        ``(update:<agent>, policy_version)``: recording the same update twice stores it once.
        """
        row = {
            "agent": [agent],
            "policy_version": [policy_version],
            "consumed_ids": [list(consumed_ids)],
            "samples_version": [samples_version],
            "num_tokens": [num_tokens],
            "checkpoint_uri": [checkpoint_uri],
            "metrics": [list((metrics or {}).items())],
            "created_at": [now()],
        }
        data = pa.table(row, schema=UPDATE_SCHEMA)
        return self.append(UPDATES, data, app_id=f"update:{agent}", seq=policy_version, schema=UPDATE_SCHEMA)

    # ---------------------------------------------------------------- reads

    def read(
        self,
        table: str,
        *,
        version: int | None = None,
        filter: pc.Expression | None = None,
        columns: list[str] | None = None,
    ) -> pa.Table:
        """Read a table at a pinned Delta version (latest when ``None``)."""
        dataset = self.open(table, version=version).to_pyarrow_dataset()
        return dataset.to_table(filter=filter, columns=columns)

    def read_samples(
        self,
        agent: str,
        *,
        version: int | None = None,
        policy_version: int | None = None,
        columns: list[str] | None = None,
    ) -> pa.Table:
        """An agent's samples, sorted by ``sample_id`` (a deterministic order for training)."""
        flt = None if policy_version is None else pc.field("policy_version") == policy_version
        rows = self.read(self.samples_table(agent), version=version, filter=flt, columns=columns)
        if "sample_id" in rows.column_names:
            rows = rows.sort_by("sample_id")
        return rows

    def policy_version(self, agent: str) -> int:
        """The agent's latest recorded policy version (0 before its first update)."""
        updates = self.read(UPDATES, filter=pc.field("agent") == agent, columns=["policy_version"])
        return int(pc.max(updates["policy_version"]).as_py() or 0) if updates.num_rows else 0

    # ---------------------------------------------------------------- inspection

    def describe(self) -> dict:
        """Tables with version, rows, files and bytes; per agent, rows by policy version."""
        tables: dict[str, dict] = {}
        for table in self.tables():
            try:
                dt = self.open(table)
                actions = dt.get_add_actions(flatten=True)
                actions = pa.table(actions) if not isinstance(actions, pa.Table) else actions
                tables[table] = {
                    "uri": self.table_uri(table),
                    "version": dt.version(),
                    "rows": int(pc.sum(actions["num_records"]).as_py() or 0) if actions.num_rows else 0,
                    "files": actions.num_rows,
                    "bytes": int(pc.sum(actions["size_bytes"]).as_py() or 0) if actions.num_rows else 0,
                }
            except DeltaError as exc:  # a corrupted table is reported, not fatal for the others
                tables[table] = {"uri": self.table_uri(table), "error": str(exc)}
        agents: dict[str, dict] = {}
        for agent in self.agents():
            table = self.samples_table(agent)
            versions = self.read(table, columns=["policy_version"])["policy_version"]
            counts = pc.value_counts(versions).to_pylist() if len(versions) else []
            agents[agent] = {
                "table": table,
                "rows": len(versions),
                "by_version": {str(c["values"]): c["counts"] for c in sorted(counts, key=lambda c: c["values"])},
            }
        return {"root": self.root, "tables": tables, "agents": agents}
