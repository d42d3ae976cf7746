from __future__ import annotations


import pyarrow as pa
import pytest
from deltalake import DeltaTable

from storage.store import ExperienceStore, StoreError


def test_same_commit_twice_is_stored_once(store: ExperienceStore, make_rows) -> None:
    first = store.append_samples("solver", make_rows("solver", ["q_0_0", "q_0_1"]), app_id="rollout:solver", seq=1)
    again = store.append_samples("solver", make_rows("solver", ["q_0_0", "q_0_1"]), app_id="rollout:solver", seq=1)
    assert not first.skipped and again.skipped
    assert again.version == first.version
    assert store.read_samples("solver").num_rows == 2
    # a later sequence number is a new commit
    store.append_samples("solver", make_rows("solver", ["q2_0_0"]), app_id="rollout:solver", seq=2)
    assert store.read_samples("solver").num_rows == 3


def test_reader_pinned_to_a_version_does_not_see_later_commits(store: ExperienceStore, make_rows) -> None:
    pinned = store.append_samples("solver", make_rows("solver", ["a_0_0"]), app_id="w", seq=1).version
    store.append_samples("solver", make_rows("solver", ["b_0_0"]), app_id="w", seq=2)
    assert store.read_samples("solver", version=pinned)["sample_id"].to_pylist() == ["a_0_0"]
    assert store.read_samples("solver")["sample_id"].to_pylist() == ["a_0_0", "b_0_0"]


def test_payload_columns_are_arrow_lists(store: ExperienceStore, make_rows) -> None:
    store.append_samples("solver", make_rows("solver", ["a_0_0"]), app_id="w", seq=1)
    schema = DeltaTable(store.table_uri("samples/solver")).to_pyarrow_dataset().schema
    for name in ("prompt_ids", "response_ids", "logprobs", "parent_ids"):
        assert pa.types.is_list(schema.field(name).type), name
    assert schema.field("prompt_ids").type.value_type == pa.int32()


def test_rows_that_do_not_match_the_schema_are_refused(store: ExperienceStore, make_rows) -> None:
    bad = make_rows("solver", ["a_0_0"]).drop_columns(["reward"])
    with pytest.raises(StoreError, match="do not match its schema"):
        store.append_samples("solver", bad, app_id="w", seq=1)
    assert store.read_samples("solver").num_rows == 0


def test_update_record_is_idempotent_and_bumps_the_version(store: ExperienceStore) -> None:
    assert store.policy_version("solver") == 0
    store.record_update("solver", 1, ["a_0_0"], samples_version=1, num_tokens=2, metrics={"loss/policy": 0.1})
    store.record_update("solver", 1, ["a_0_0"], samples_version=1, num_tokens=2)  # a retried record
    assert store.policy_version("solver") == 1
    assert store.policy_version("verifier") == 0
    assert store.read("updates").num_rows == 1


def test_describe_counts_rows_per_policy_version(store: ExperienceStore, make_rows) -> None:
    store.append_samples("solver", make_rows("solver", ["a_0_0", "a_0_1"]), app_id="w", seq=1)
    store.append_samples("solver", make_rows("solver", ["b_0_0"], policy_version=1), app_id="w", seq=2)
    info = store.describe()
    assert info["agents"]["solver"] == {"table": "samples/solver", "rows": 3, "by_version": {"0": 2, "1": 1}}
    assert info["tables"]["samples/solver"]["rows"] == 3
    assert info["tables"]["samples/solver"]["version"] == 2
    assert info["agents"]["verifier"]["rows"] == 0


def test_opening_a_missing_store_names_the_problem(tmp_path) -> None:
    with pytest.raises(StoreError, match="no Delta table"):
        ExperienceStore(tmp_path / "nothing").read_samples("solver")


def test_eight_concurrent_writer_processes_lose_nothing(tmp_path, writer_processes) -> None:
    root = str(tmp_path / "store")
    ExperienceStore(root).create(["solver"])
    assert writer_processes(root, writers=8, commits=12) == [0] * 8
    ids = ExperienceStore(root).read_samples("solver")["sample_id"].to_pylist()
    assert len(ids) == len(set(ids)) == 8 * 12
