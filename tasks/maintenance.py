"""Prefect task of the store maintenance flow: one table's compaction, checkpoint and vacuum."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from storage.store import StoreSpec


# A retry is safe: compaction, checkpoints and vacuum are idempotent, and a compaction that meets another one
# holding the table's lease skips it.
@task(name="maintain-table", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      task_run_name="maintain-{table}")
def maintain_table(store: StoreSpec, table: str, vacuum_retention_hours: float) -> dict:
    """Compact, checkpoint and vacuum one table of the store; returns one flat row of metrics."""
    maintenance = store.open().maintenance
    compact = maintenance.compact(table)[table]
    checkpoint = maintenance.checkpoint(table)[table]
    vacuum = maintenance.vacuum(table, retention_hours=vacuum_retention_hours)[table]
    return {
        "table": table,
        "version": checkpoint["version"],
        "files_before": compact["files_before"],
        "files_after": compact["files_after"],
        "compaction_skipped_busy": compact["busy"],
        "commit_files": checkpoint["commit_files"],
        "commit_files_deleted": checkpoint["commit_files_deleted"],
        "data_files_vacuumed": vacuum["files_deleted"],
    }
