"""The training read (``read_micro_batch``) and the spec a worker opens the store from."""

from __future__ import annotations

import pickle

from storage.store import ExperienceStore, StoreSpec


def ids(table) -> list[str]:
    return table["sample_id"].to_pylist()


def test_a_micro_batch_is_read_whole_sorted_and_at_its_commit_version(store: ExperienceStore, make_rows) -> None:
    all_ids = [f"q{i:02d}_0_{t}" for i in range(5) for t in range(4)]
    # committed in two micro-batches, out of order
    first = store.append_samples("solver", make_rows("solver", all_ids[10:][::-1]), app_id="r", seq=1).version
    store.append_samples("solver", make_rows("solver", all_ids[:10]), app_id="r", seq=2)
    batch = store.read_micro_batch("solver", all_ids[10:][::-1], version=first)
    assert ids(batch) == all_ids[10:]  # sorted, whatever order the ids came in
    assert batch.column_names == store.read_samples("solver").column_names  # full rows, not just ids
    assert batch["response_ids"].to_pylist()[0] == [4, 5]
    # pinned: the later commit is not there yet
    assert store.read_micro_batch("solver", all_ids[:12], version=first).num_rows == 2
    latest = store.version(store.samples_table("solver"))
    assert ids(store.read_micro_batch("solver", all_ids[:3], version=latest)) == all_ids[:3]
    assert store.read_micro_batch("verifier", all_ids, version=0).num_rows == 0  # another agent's table


def test_the_spec_a_worker_gets_carries_the_storage_options(tmp_path) -> None:
    # an object-store run keeps its credentials in store.storage_options; a worker must open the store with them
    options = {"AWS_ACCESS_KEY_ID": "k", "AWS_ENDPOINT_URL": "http://minio:9000"}
    store = ExperienceStore(tmp_path / "store", storage_options=options)
    spec = pickle.loads(pickle.dumps(store.spec))  # as Dask ships it to the trainer
    assert spec == StoreSpec(store.root, options)
    opened = spec.open()
    assert opened.root == store.root and opened.storage_options == options
