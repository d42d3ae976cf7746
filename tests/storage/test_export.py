"""export_samples: Parquet and JSON Lines files that read back to the stored rows."""

from __future__ import annotations

import pyarrow.json as pj
import pyarrow.parquet as pq
import pytest

from storage.export import export_samples
from storage.schema import SAMPLE_SCHEMA
from storage.store import ExperienceStore


@pytest.fixture
def filled(store: ExperienceStore, make_rows) -> ExperienceStore:
    store.append_samples("solver", make_rows("solver", ["b_0_0", "a_0_0"], parents=[["x_0_0"], []]), app_id="r", seq=1)
    store.append_samples("solver", make_rows("solver", ["c_0_0"], policy_version=1), app_id="r", seq=2)
    return store


def test_parquet_export_round_trips(filled: ExperienceStore, tmp_path) -> None:
    result = export_samples(filled, "solver", tmp_path / "out.parquet", format="parquet")
    back = pq.read_table(tmp_path / "out.parquet")
    assert result.rows == 3 and result.version == filled.version("samples/solver")
    assert back.equals(filled.read_samples("solver"))


def test_jsonl_export_round_trips_and_filters_by_policy_version(filled: ExperienceStore, tmp_path) -> None:
    out = tmp_path / "v0.jsonl"
    result = export_samples(filled, "solver", out, format="jsonl", policy_version=0)
    assert result.rows == 2 and len(out.read_text().splitlines()) == 2
    back = pj.read_json(out, parse_options=pj.ParseOptions(explicit_schema=SAMPLE_SCHEMA))
    stored = filled.read_samples("solver", policy_version=0)
    assert back.to_pylist() == stored.to_pylist()  # lists, nulls and timestamps included
    assert back["parent_ids"].to_pylist() == [[], ["x_0_0"]]


def test_an_unknown_format_is_refused(filled: ExperienceStore, tmp_path) -> None:
    with pytest.raises(ValueError, match="parquet' or 'jsonl"):
        export_samples(filled, "solver", tmp_path / "x.csv", format="csv")  # type: ignore[arg-type]
