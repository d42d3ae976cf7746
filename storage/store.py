"""The MEG Store: one Delta table per agent, an episodes table and an updates table under one root.

Every append is idempotent: the caller names the logical writer (``app_id``) and a sequence number
(``seq``) that only grows; the store records both in the same Delta commit (``Transaction``) and skips a
commit whose sequence number was already recorded. A retried or re-run task therefore never writes a row
twice. Readers pin a Delta version, so every stage sees one consistent snapshot.

A trainer reads its micro-batch with ``read_micro_batch``: the committed sample ids the driver hands it, at the
Delta version it committed them in. Workers open the store from a ``StoreSpec`` (root and storage options).
Maintenance (compaction, checkpoints, vacuum) lives under ``store.maintenance``; an append that leaves a
table with many small files compacts it (``compact_after_files``).

Example:
    >>> store = ExperienceStore("runs/demo/store")
    >>> store.create(["solver", "verifier"])
    >>> store.append_samples("solver", rows, app_id="rollout:solver", seq=1)
    >>> batch = store.read_micro_batch("solver", ["s0q0_0_0", "s0q0_0_1"], version=commit.version)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import DeltaError, TableNotFoundError

from storage.config import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_COMPACT_AFTER_FILES
from storage.maintenance import StoreMaintenance
from storage.schema import EPISODE_SCHEMA, SAMPLE_SCHEMA, UPDATE_SCHEMA
from storage.tables import (  # noqa: F401 - the store's own errors, importable from here
    StoreError, TableLoadError, commit_retries, describe_delta_error, error_summary, first_unloadable_version,
)

if TYPE_CHECKING:
    from storage.config import StoreConfig

log = logging.getLogger(__name__)

SAMPLES_DIR = "samples"
EPISODES = "episodes"
UPDATES = "updates"


@dataclass(frozen=True)
class Commit:
    """Result of an idempotent append."""

    table: str
    version: int  # Delta version that holds the rows
    skipped: bool  # True when this (app_id, seq) was already committed


@dataclass(frozen=True)
class StoreSpec:
    """Where a store is and how to reach it: what a worker needs to open it. Plain strings, so it pickles
    into a Dask task; the storage options (object-store credentials) travel with the root."""

    root: str
    storage_options: dict[str, str] | None = None

    def open(self) -> ExperienceStore:
        return ExperienceStore(self.root, storage_options=self.storage_options)


def now() -> datetime:
    return datetime.now(UTC)


class ExperienceStore:
    """Versioned, exactly-once experience store on Delta Lake.

    Args:
        root: a local directory or any URI deltalake supports (``s3://...``).
        storage_options: passed to deltalake for object stores.
        max_commit_attempts: our own retries (with jittered backoff) on top of deltalake's, for commit
            conflicts between concurrent writers.
        compact_after_files: compact a table after an append that leaves it with at least this many data
            files; 0 turns automatic compaction off.
        checkpoint_interval: commits between Delta checkpoints of the tables this store creates.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        storage_options: dict[str, str] | None = None,
        max_commit_attempts: int = 10,
        compact_after_files: int = DEFAULT_COMPACT_AFTER_FILES,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
    ) -> None:
        if compact_after_files < 0:
            raise ValueError(f"compact_after_files must be >= 0 (0 turns it off), got {compact_after_files}")
        root = str(root)
        self.root = root if "://" in root else os.path.abspath(root)
        self.storage_options = storage_options
        self.max_commit_attempts = max_commit_attempts
        self.compact_after_files = compact_after_files
        self.checkpoint_interval = checkpoint_interval

    @property
    def spec(self) -> StoreSpec:
        return StoreSpec(self.root, self.storage_options)

    @classmethod
    def from_config(cls, uri: str | os.PathLike, cfg: StoreConfig) -> ExperienceStore:
        """The store at ``uri`` with the settings of a run's ``store`` config section."""
        return cls(
            uri,
            storage_options=cfg.storage_options or None,
            compact_after_files=cfg.compact_after_files,
            checkpoint_interval=cfg.checkpoint_interval,
        )

    @property
    def maintenance(self) -> StoreMaintenance:
        """Compaction, checkpoints and vacuum of this store's tables (see ``storage.maintenance``)."""
        return StoreMaintenance(self)

    # ---------------------------------------------------------------- table names and creation

    def table_uri(self, table: str) -> str:
        """URI of a table: ``"episodes"``, ``"updates"`` or ``"samples/<agent>"``."""
        return f"{self.root}/{table}"

    @staticmethod
    def samples_table(agent: str) -> str:
        return f"{SAMPLES_DIR}/{agent}"

    def create(self, agents: Iterable[str]) -> None:
        """Create any missing table (empty, with its schema). Safe to call on an existing store: existing
        tables, and their properties, are left as they are."""
        wanted = {EPISODES: EPISODE_SCHEMA, UPDATES: UPDATE_SCHEMA}
        wanted.update({self.samples_table(a): SAMPLE_SCHEMA for a in agents})
        for table, schema in wanted.items():
            write_deltalake(
                self.table_uri(table),
                schema.empty_table(),
                mode="ignore",  # leaves an existing table untouched
                configuration={"delta.checkpointInterval": str(self.checkpoint_interval)},
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
                f"no Delta table {table!r} under {self.root}: is this a FlexMARL store? Give a run directory or "
                "its 'store/' folder"
            ) from exc
        except DeltaError as exc:  # a damaged log: one line naming the table, the version and the fix
            raise TableLoadError(table, describe_delta_error(self.table_uri(table), exc, self.storage_options)) from exc

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

        for attempt in commit_retries(self.max_commit_attempts, multiplier=0.02, max_wait=1.0):
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
                commit = Commit(table, dt.version(), skipped=False)
                break
        # The file count comes from the snapshot we already hold (the log), not from listing the directory.
        if self.compact_after_files and len(dt.file_uris()) >= self.compact_after_files:
            self._compact_quietly(table)
        return commit

    def _compact_quietly(self, table: str) -> None:
        """Automatic compaction: best effort, since the rows are already committed and a later append retries."""
        try:
            self.maintenance.compact(table)
        except (DeltaError, StoreError, OSError) as exc:
            log.warning("automatic compaction of %s under %s failed (the append itself is committed): %s",
                        table, self.root, exc)

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
        prune: list[tuple[str, str, object]] | None = None,
    ) -> pa.Table:
        """Read a table at a pinned Delta version (latest when ``None``); ``prune`` as in ``dataset``."""
        return self.dataset(table, version=version, prune=prune).to_table(filter=filter, columns=columns)

    def dataset(
        self,
        table: str,
        *,
        version: int | None = None,
        dt: DeltaTable | None = None,
        prune: list[tuple[str, str, object]] | None = None,
    ) -> ds.Dataset:
        """A pyarrow dataset of the table at a pinned version (or of ``dt``, an already opened snapshot).

        ``prune`` keeps only the files whose statistics allow a match, e.g. ``[("policy_version", "=", 3)]``;
        building a dataset costs about 1 ms per file, so this matters for tables that are not compacted.

        Local tables are read through pyarrow's own file system. deltalake's default, a file system written in
        Python, leaves read-ahead buffers that the interpreter may free after it has shut down, which aborts
        the process at exit ("terminate called without an active exception") in about one run in four.
        """
        dt = dt if dt is not None else self.open(table, version=version)
        if "://" in self.root and not self.root.startswith("file://"):
            return dt.to_pyarrow_dataset(file_pruning_predicate=prune)
        local, path = pafs.FileSystem.from_uri(self.table_uri(table))
        return dt.to_pyarrow_dataset(filesystem=pafs.SubTreeFileSystem(path, local), file_pruning_predicate=prune)

    def read_samples(
        self,
        agent: str,
        *,
        version: int | None = None,
        policy_version: int | None = None,
        columns: list[str] | None = None,
    ) -> pa.Table:
        """An agent's samples, sorted by ``sample_id`` (a deterministic order for training)."""
        flt, prune = None, None
        if policy_version is not None:
            flt, prune = pc.field("policy_version") == policy_version, [("policy_version", "=", policy_version)]
        rows = self.read(self.samples_table(agent), version=version, filter=flt, columns=columns, prune=prune)
        if "sample_id" in rows.column_names:
            rows = rows.sort_by("sample_id")
        return rows

    def consumed_ids(self, agent: str, *, version: int | None = None, newer_than: int | None = None) -> pa.Array:
        """Sample ids that ``agent``'s recorded updates consumed (read from the updates table).

        ``newer_than`` keeps only the updates that produced a version above it: the only ones that can have
        consumed samples generated by that version, since an update to v trains on samples of versions < v.
        """
        flt = pc.field("agent") == agent
        if newer_than is not None:
            flt &= pc.field("policy_version") > newer_than
        updates = self.read(UPDATES, version=version, filter=flt, columns=["consumed_ids"])
        if not updates.num_rows:
            return pa.array([], pa.string())
        return pc.list_flatten(updates["consumed_ids"]).combine_chunks()

    def read_micro_batch(self, agent: str, sample_ids: Sequence[str], *, version: int) -> pa.Table:
        """The training read: the agent's samples ``sample_ids`` at Delta version ``version`` (where the driver
        committed them), sorted by ``sample_id``. The id filter is pushed down, so file statistics skip the
        files that hold none of them."""
        wanted = pc.field("sample_id").isin(pa.array(list(sample_ids), pa.string()))
        return self.read(self.samples_table(agent), version=version, filter=wanted).sort_by("sample_id")

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
                tables[table] = {"uri": self.table_uri(table), "error": error_summary(exc)}
        agents: dict[str, dict] = {}
        for agent in self.agents():
            table = self.samples_table(agent)
            if "error" in tables.get(table, {}):
                agents[agent] = {"table": table, "error": tables[table]["error"]}
                continue
            try:
                versions = self.read(table, columns=["policy_version"])["policy_version"]
            except (OSError, pa.ArrowException) as exc:  # a data file is missing or damaged
                agents[agent] = {"table": table, "error": error_summary(exc)}
                continue
            counts = pc.value_counts(versions).to_pylist() if len(versions) else []
            agents[agent] = {
                "table": table,
                "rows": len(versions),
                "by_version": {str(c["values"]): c["counts"] for c in sorted(counts, key=lambda c: c["values"])},
            }
        return {"root": self.root, "tables": tables, "agents": agents}
