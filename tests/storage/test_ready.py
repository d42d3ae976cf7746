"""ExperienceStore.ready: the next micro-batch of rewarded, unconsumed samples, deterministically ordered."""

from __future__ import annotations

import pytest

from storage.schema import SampleStatus
from storage.store import ExperienceStore


def ids(table) -> list[str]:
    return table["sample_id"].to_pylist()


def test_ready_excludes_consumed_and_unrewarded_rows_and_other_versions(store: ExperienceStore, make_rows) -> None:
    store.append_samples("solver", make_rows("solver", ["c_0_0", "a_0_0", "b_0_0"]), app_id="r", seq=1)
    store.append_samples("solver", make_rows("solver", ["d_0_0"], status=SampleStatus.GENERATED), app_id="r", seq=2)
    store.append_samples("solver", make_rows("solver", ["e_0_0"], policy_version=1), app_id="r", seq=3)
    store.append_samples("verifier", make_rows("verifier", ["f_1_0"]), app_id="r", seq=1)

    batch, version = store.ready("solver", 0, 10)
    assert ids(batch) == ["a_0_0", "b_0_0", "c_0_0"]  # sorted; no generated row, no v1 row, no other agent
    assert version == store.version("samples/solver")

    store.record_update("solver", 1, ["a_0_0", "c_0_0"], samples_version=version, num_tokens=4)
    assert ids(store.ready("solver", 0, 10).rows) == ["b_0_0"]
    assert ids(store.ready("solver", 1, 10).rows) == ["e_0_0"]
    assert store.ready("verifier", 0, 10).rows.num_rows == 1  # the solver's update consumed nothing of it


def test_ready_pages_deterministically(store: ExperienceStore, make_rows) -> None:
    all_ids = [f"q{i:02d}_0_{t}" for i in range(5) for t in range(4)]
    # committed in two micro-batches, out of order
    store.append_samples("solver", make_rows("solver", all_ids[10:]), app_id="r", seq=1)
    store.append_samples("solver", make_rows("solver", all_ids[:10][::-1]), app_id="r", seq=2)

    first, pinned = store.ready("solver", 0, 8)
    assert ids(first) == all_ids[:8]
    assert ids(store.ready("solver", 0, 8, version=pinned).rows) == ids(first)  # the same call, the same rows
    pages, after = [], None
    while True:
        page, _ = store.ready("solver", 0, 8, version=pinned, after=after)
        if page.num_rows == 0:
            break
        pages.append(ids(page))
        after = page["sample_id"][-1].as_py()
    assert [len(p) for p in pages] == [8, 8, 4]
    assert sum(pages, []) == all_ids
    # full rows, not just ids
    assert first.column_names == store.read_samples("solver").column_names
    assert first["response_ids"].to_pylist()[0] == [4, 5]


def test_ready_reads_at_the_pinned_version(store: ExperienceStore, make_rows) -> None:
    pinned = store.append_samples("solver", make_rows("solver", ["b_0_0"]), app_id="r", seq=1).version
    store.append_samples("solver", make_rows("solver", ["a_0_0"]), app_id="r", seq=2)
    assert ids(store.ready("solver", 0, 10, version=pinned).rows) == ["b_0_0"]
    assert ids(store.ready("solver", 0, 10).rows) == ["a_0_0", "b_0_0"]


def test_ready_with_nothing_ready_returns_an_empty_table(store: ExperienceStore) -> None:
    batch, version = store.ready("solver", 0, 4)
    assert batch.num_rows == 0 and "sample_id" in batch.column_names
    with pytest.raises(ValueError, match="n must be >= 1"):
        store.ready("solver", 0, 0)
