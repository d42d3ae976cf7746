"""Maintenance of the MEG Store's Delta tables: compaction, checkpoints and vacuum.

Reached as ``store.maintenance`` (delta-rs keeps ``dt.optimize`` apart from ``DeltaTable`` the same way). Every
operation takes one table name, or ``None`` for every table of the store, and returns its metrics per table.
All three are idempotent, so a retried maintenance task is safe.

Compaction runs under a lease. deltalake (1.6) lets two compactions that rewrite the same files both commit,
since both only rearrange data (``dataChange=false``), and the table then holds every such row twice. So a
compactor first claims the table with an otherwise empty commit carrying a Delta app transaction
(``flexmarl:compaction``): two claims conflict, exactly one wins, and the loser skips. Appends are blind appends
and never conflict with compaction; deltalake rebases a compaction over them.

Example:
    >>> store.maintenance.compact("samples/solver")
    {'samples/solver': {'files_before': 212, 'files_after': 1, 'files_removed': 212, 'files_added': 1,
     'version': 215, 'busy': False}}
    >>> store.maintenance.vacuum(retention_hours=168)  # dry_run=False: this one deletes
"""

from __future__ import annotations

import math
import time

import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction, WriterProperties
from deltalake.exceptions import CommitFailedError, DeltaError

from storage.tables import StoreError, Tables, commit_retries

COMPACTION_LEASE = "flexmarl:compaction"
# Row groups of compacted files: a reader of one micro-batch then decodes about this many rows per file
# (the row-group statistics skip the others), not the whole file. 1,024 halved a
# micro-batch read (the consumption-aware ``ready()`` of the time) on a compacted table.
COMPACTED_ROW_GROUP_ROWS = 1024
# A lease older than this is taken to belong to a dead compactor and may be taken over.
LEASE_TTL_S = 30 * 60


def _lease_version(now_s: float, *, held: bool) -> int:
    """App-transaction versions encode the lease: milliseconds since the epoch, times two, plus 1 while held.

    Delta keeps only a number per app id, so the time of the claim and the held bit share it.
    """
    return int(now_s * 1000) * 2 + int(held)


def _lease_state(version: int | None) -> tuple[bool, float]:
    """(held, claimed at, in epoch seconds) of a lease version; a never-claimed lease is free."""
    if version is None:
        return False, 0.0
    return bool(version % 2), (version // 2) / 1000


class StoreMaintenance:
    """Compaction, checkpoints and vacuum of an ``ExperienceStore``'s tables.

    Args:
        store: the store to maintain.
        max_commit_attempts: our retries of a compaction commit (with jittered backoff) on top of deltalake's.
    """

    def __init__(self, store: Tables, *, max_commit_attempts: int = 5) -> None:
        self.store = store
        self.max_commit_attempts = max_commit_attempts

    def _tables(self, table: str | None) -> list[str]:
        return self.store.tables() if table is None else [table]

    # ---------------------------------------------------------------- compaction

    def compact(self, table: str | None = None, *, target_size: int | None = None) -> dict[str, dict]:
        """Merge each table's small files into large ones. Rows and their order within files are kept.

        A table with fewer than two files is left alone. A table that another compactor holds is skipped
        and reported with ``busy: True``.

        Args:
            table: ``"episodes"``, ``"updates"``, ``"samples/<agent>"``, or ``None`` for every table.
            target_size: approximate file size in bytes (deltalake's default: 100 MB).

        Returns:
            Per table: ``files_before``, ``files_after``, ``files_removed``, ``files_added``, ``version``
            (the table's Delta version afterwards) and ``busy``.
        """
        return {t: self._compact_one(t, target_size) for t in self._tables(table)}

    def _compact_one(self, table: str, target_size: int | None) -> dict:
        dt = self.store.open(table)
        before = len(dt.file_uris())
        result = {"files_before": before, "files_after": before, "files_removed": 0, "files_added": 0,
                  "version": dt.version(), "busy": False}
        if before < 2:
            return result
        lease = self._claim(dt)
        if lease is None:
            return result | {"busy": True}
        try:
            for attempt in commit_retries(self.max_commit_attempts, multiplier=0.05, max_wait=2.0):
                with attempt:
                    # Plan from a snapshot taken after our claim, so it includes any earlier compaction.
                    dt = self.store.open(table)
                    metrics = dt.optimize.compact(
                        target_size=target_size,
                        writer_properties=WriterProperties(max_row_group_size=COMPACTED_ROW_GROUP_ROWS),
                    )
        finally:
            self._release(table, lease)
        dt = self.store.open(table)
        return result | {
            "files_after": len(dt.file_uris()),
            "files_removed": int(metrics.get("numFilesRemoved", 0)),
            "files_added": int(metrics.get("numFilesAdded", 0)),
            "version": dt.version(),
        }

    def _claim(self, dt: DeltaTable) -> int | None:
        """Take the table's compaction lease; the claimed version, or None when another compactor holds it."""
        now = time.time()
        current = dt.transaction_version(COMPACTION_LEASE)
        held, since = _lease_state(current)
        if held and now - since < LEASE_TTL_S:
            return None
        claim = max(_lease_version(now, held=True), (current or 0) + 1)
        claim += 1 - claim % 2  # odd: held
        try:
            self._commit_lease(dt, claim)
        except CommitFailedError:  # a concurrent claim won: exactly one compactor goes ahead
            return None
        return claim

    def _release(self, table: str, claim: int) -> None:
        try:
            self._commit_lease(self.store.open(table), claim + 1)
        except (DeltaError, OSError):  # the lease then expires after LEASE_TTL_S
            pass

    def _commit_lease(self, dt: DeltaTable, version: int) -> None:
        # A commit with no files, only the app transaction: a conflicting concurrent claim makes it fail.
        dt.create_write_transaction(
            [], mode="append", schema=dt.schema(),
            commit_properties=CommitProperties(app_transactions=[Transaction(COMPACTION_LEASE, version)]),
        )

    # ---------------------------------------------------------------- checkpoints

    def checkpoint(self, table: str | None = None) -> dict[str, dict]:
        """Write a checkpoint at each table's current version, then delete commit files past their retention
        (``delta.logRetentionDuration``, 30 days by default). Later opens replay the log from the checkpoint.

        Returns:
            Per table: ``version`` (checkpointed), ``commit_files`` (JSON commits left in the log) and
            ``commit_files_deleted``.
        """
        out = {}
        for t in self._tables(table):
            dt = self.store.open(t)
            before = self._commit_files(t)
            dt.create_checkpoint()
            dt.cleanup_metadata()
            after = self._commit_files(t)
            out[t] = {"version": dt.version(), "commit_files": after, "commit_files_deleted": before - after}
        return out

    def _commit_files(self, table: str) -> int:
        fs, path = pafs.FileSystem.from_uri(f"{self.store.table_uri(table)}/_delta_log")
        infos = fs.get_file_info(pafs.FileSelector(path))
        return sum(1 for i in infos if i.type == pafs.FileType.File and i.extension == "json")

    # ---------------------------------------------------------------- vacuum

    def vacuum(
        self,
        table: str | None = None,
        *,
        retention_hours: float = 168,
        dry_run: bool = False,
        enforce_retention_duration: bool = True,
    ) -> dict[str, dict]:
        """Delete data files that no version younger than ``retention_hours`` references.

        Unlike deltalake's ``vacuum``, this deletes unless ``dry_run=True``. A reader pinned to a version
        older than the retention may fail afterwards, so keep it above the age of any pinned read (a
        trainer's batch, an export in progress).

        Args:
            table: one table or ``None`` for every table.
            retention_hours: keep files removed less than this long ago; rounded up to whole hours.
            dry_run: only list what would be deleted.
            enforce_retention_duration: refuse a retention below the table's
                ``delta.deletedFileRetentionDuration`` (one week by default).

        Returns:
            Per table: ``files_deleted`` (or, in a dry run, that would be), ``dry_run`` and ``files``.

        Raises:
            StoreError: the retention is below the table's minimum while it is enforced.
        """
        if retention_hours < 0:
            raise ValueError(f"retention_hours must be >= 0, got {retention_hours}")
        hours = math.ceil(retention_hours)  # deltalake takes whole hours: round towards keeping more
        out = {}
        for t in self._tables(table):
            try:
                files = self.store.open(t).vacuum(
                    retention_hours=hours, dry_run=dry_run, enforce_retention_duration=enforce_retention_duration
                )
            except DeltaError as exc:
                if "retention" not in str(exc).lower():
                    raise
                raise StoreError(
                    f"vacuum of {t!r} refused a retention of {hours} h: {exc}. Keep retention_hours at or above "
                    "the table's minimum (168 by default), or pass enforce_retention_duration=False if no reader "
                    "pins an older version"
                ) from exc
            out[t] = {"files_deleted": len(files), "dry_run": dry_run, "files": sorted(files)}
        return out
