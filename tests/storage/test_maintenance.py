"""store.maintenance: compaction (manual, automatic, and racing other writers), checkpoints and vacuum."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from storage.config import StoreConfig
from storage.maintenance import COMPACTED_ROW_GROUP_ROWS, COMPACTION_LEASE, StoreMaintenance
from storage.store import ExperienceStore, StoreError


def fill(store: ExperienceStore, make_rows, commits: int, *, agent: str = "solver") -> list[str]:
    ids = []
    for k in range(commits):
        batch = [f"q{k:03d}_0_{t}" for t in range(3)]
        store.append_samples(agent, make_rows(agent, batch, policy_version=k // 4), app_id="rollout", seq=k + 1)
        ids += batch
    return ids


def files(store: ExperienceStore, table: str = "samples/solver") -> int:
    return len(store.open(table).file_uris())


def test_compaction_keeps_every_row_and_lowers_the_file_count(store: ExperienceStore, make_rows) -> None:
    ids = fill(store, make_rows, 6)
    before = store.read_samples("solver")
    assert files(store) == 6

    metrics = store.maintenance.compact("samples/solver")["samples/solver"]
    assert metrics["files_before"] == 6 and metrics["files_after"] == files(store) == 1
    assert metrics["files_removed"] == 6 and not metrics["busy"]
    after = store.read_samples("solver")
    assert after["sample_id"].to_pylist() == sorted(ids)
    assert after.equals(before)
    assert store.open("samples/solver").transaction_version("rollout") == 6  # idempotency keys survive
    # idempotent: a second compaction finds nothing to do
    again = store.maintenance.compact("samples/solver")["samples/solver"]
    assert again["files_before"] == again["files_after"] == 1 and again["files_removed"] == 0


def test_compacting_every_table_reports_each(store: ExperienceStore, make_rows) -> None:
    fill(store, make_rows, 3)
    metrics = store.maintenance.compact()
    assert set(metrics) == {"episodes", "updates", "samples/solver", "samples/verifier"}
    assert metrics["samples/solver"]["files_after"] == 1


def test_an_append_past_the_threshold_compacts_the_table(tmp_path, make_rows) -> None:
    store = ExperienceStore(tmp_path / "store", compact_after_files=4)
    store.create(["solver"])
    counts = []
    for k in range(9):
        store.append_samples("solver", make_rows("solver", [f"q{k}_0_0"]), app_id="r", seq=k + 1)
        counts.append(files(store))
    assert counts == [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert store.read_samples("solver").num_rows == 9

    off = ExperienceStore(tmp_path / "off", compact_after_files=0)
    off.create(["solver"])
    fill(off, make_rows, 5)
    assert files(off) == 5


def test_a_held_lease_makes_a_second_compactor_skip(store: ExperienceStore, make_rows) -> None:
    fill(store, make_rows, 3)
    maintenance = StoreMaintenance(store)
    # two compactors that read the same snapshot: the first claim wins, the second conflicts and skips
    first, second = store.open("samples/solver"), store.open("samples/solver")
    claim = maintenance._claim(first)
    assert claim is not None and claim % 2 == 1
    assert maintenance._claim(second) is None
    # while the lease is held, compaction reports busy and leaves the files alone
    busy = store.maintenance.compact("samples/solver")["samples/solver"]
    assert busy["busy"] and files(store) == 3
    maintenance._release("samples/solver", claim)
    assert store.open("samples/solver").transaction_version(COMPACTION_LEASE) == claim + 1
    assert store.maintenance.compact("samples/solver")["samples/solver"]["files_after"] == 1
    assert store.read_samples("solver").num_rows == 9


def test_concurrent_writers_that_compact_lose_and_duplicate_nothing(tmp_path, writer_processes) -> None:
    # Every writer compacts whenever it sees 3 files, so compactions race each other and the appends.
    root = str(tmp_path / "store")
    ExperienceStore(root).create(["solver"])
    assert writer_processes(root, writers=4, commits=10, store_args=", compact_after_files=3") == [0] * 4
    store = ExperienceStore(root)
    ids = store.read_samples("solver")["sample_id"].to_pylist()
    assert sorted(ids) == sorted(f"w{w}c{k}_0_0" for w in range(4) for k in range(10))  # none lost, none twice
    history = store.open("samples/solver").history()
    assert any(h["operation"] == "OPTIMIZE" for h in history)


def test_checkpoint_writes_a_checkpoint_at_the_current_version(store: ExperienceStore, make_rows) -> None:
    fill(store, make_rows, 3)
    metrics = store.maintenance.checkpoint("samples/solver")["samples/solver"]
    version = store.version("samples/solver")
    assert metrics["version"] == version
    log = Path(store.table_uri("samples/solver")) / "_delta_log"
    assert (log / f"{version:020d}.checkpoint.parquet").exists()
    assert store.read_samples("solver").num_rows == 9


def test_vacuum_deletes_only_unreferenced_files_and_is_not_a_dry_run(store: ExperienceStore, make_rows) -> None:
    fill(store, make_rows, 4)
    store.maintenance.compact("samples/solver")
    table = Path(store.table_uri("samples/solver"))
    on_disk = lambda: len(list(table.glob("*.parquet")))  # noqa: E731
    assert on_disk() == 5  # 4 small files, now removed from the table, and the compacted one

    planned = store.maintenance.vacuum("samples/solver", retention_hours=0, dry_run=True,
                                       enforce_retention_duration=False)["samples/solver"]
    assert planned["files_deleted"] == 4 and planned["dry_run"] and on_disk() == 5
    done = store.maintenance.vacuum("samples/solver", retention_hours=0,
                                    enforce_retention_duration=False)["samples/solver"]
    assert done["files_deleted"] == 4 and on_disk() == 1
    assert store.read_samples("solver").num_rows == 12

    # the default retention keeps files removed less than a week ago
    fill_more = [f"z_0_{t}" for t in range(2)]
    store.append_samples("solver", make_rows("solver", fill_more), app_id="late", seq=1)
    store.maintenance.compact("samples/solver")
    assert store.maintenance.vacuum("samples/solver")["samples/solver"]["files_deleted"] == 0


def test_vacuum_below_the_minimum_retention_names_the_fix(store: ExperienceStore) -> None:
    with pytest.raises(StoreError, match="enforce_retention_duration=False"):
        store.maintenance.vacuum("samples/solver", retention_hours=1)


def test_compacted_files_keep_row_groups_small(store: ExperienceStore, make_rows) -> None:
    for k in range(2):
        store.append_samples("solver", make_rows("solver", [f"q{k}_{i:04d}_0" for i in range(700)]), app_id="r",
                             seq=k + 1)
    store.maintenance.compact("samples/solver")
    (path,) = store.open("samples/solver").file_uris()
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_rows == 1400
    assert max(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)) <= COMPACTED_ROW_GROUP_ROWS


def test_tables_are_created_with_the_configured_checkpoint_interval(tmp_path) -> None:
    cfg = StoreConfig(checkpoint_interval=3, compact_after_files=7)
    store = ExperienceStore.from_config(tmp_path / "store", cfg)
    assert store.compact_after_files == 7
    store.create(["solver"])
    for table in store.tables():
        assert store.open(table).metadata().configuration["delta.checkpointInterval"] == "3"
