"""The store maintenance flow: compact, checkpoint and vacuum every table of a MEG Store.

Deployed with a daily schedule (inactive until turned on) as ``flexmarl-maintain-store/daily`` in
``prefect.yaml``. It is safe beside a running training run: appends never conflict with compaction, and a
compaction already under way (a run's automatic one) holds a lease, so this one skips that table.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.waiting import wait_for
from storage.store import UPDATES, ExperienceStore
from tasks.maintenance import maintain_table


@flow(name="flexmarl-maintain-store", log_prints=True)
def maintain_store(store_uri: str, vacuum_retention_hours: float = 168, table_timeout_s: float = 3600,
                   storage_options: dict[str, str] | None = None) -> list[dict]:
    """Compact, checkpoint and vacuum every table of the store at ``store_uri``.

    Args:
        store_uri: the store root (a run directory's ``store/`` folder, or an object-store URI).
        vacuum_retention_hours: delete data files removed at least this long ago. Readers pinned to older
            versions fail afterwards; the default (one week) is also deltalake's minimum.
        table_timeout_s: the flow fails, naming the table, when one table's maintenance (retries included)
            takes longer.
        storage_options: deltalake's options for an object store (credentials, endpoint), as the run's
            ``store.storage_options``.

    Returns:
        One row of metrics per table (also published as the ``store-maintenance`` table artifact).
    """
    logger = get_run_logger()
    store = ExperienceStore(store_uri, storage_options=storage_options)
    store.version(UPDATES)  # fails at once, naming the problem, when store_uri is not a store
    tables = store.tables()
    futures = [maintain_table.submit(store.spec, table, vacuum_retention_hours) for table in tables]
    rows = [wait_for(f, f"maintenance of table {t!r}", table_timeout_s, "the table_timeout_s parameter")
            for t, f in zip(tables, futures, strict=True)]
    create_table_artifact(rows, key="store-maintenance", description=f"Maintenance of the store {store_uri}")
    for r in rows:
        logger.info("%s: files %d -> %d, %d data files vacuumed", r["table"], r["files_before"], r["files_after"],
                    r["data_files_vacuumed"])
    return rows


if __name__ == "__main__":
    import sys

    maintain_store(sys.argv[1])
