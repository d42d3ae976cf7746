"""--where filters: what they select through DataFusion, and what they refuse before DataFusion sees them."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from storage.schema import SAMPLE_SCHEMA
from storage.where import FilterError, filter_columns, select_where

ROWS = [
    {"node": "solver", "reward": 1.0, "policy_version": 0, "parsed": "7", "finish_reason": "stop"},
    {"node": "solver", "reward": 0.0, "policy_version": 1, "parsed": None, "finish_reason": "length"},
    {"node": "verifier", "reward": None, "policy_version": 1, "parsed": "1", "finish_reason": "stop"},
    {"node": "verifier", "reward": 0.5, "policy_version": 2, "parsed": "it's", "finish_reason": "stop"},
]


@pytest.fixture
def table(make_rows, tmp_path) -> DeltaTable:
    base = make_rows("solver", [f"q_{i}_0" for i in range(len(ROWS))]).to_pylist()  # advantage 0.5 in every row
    for row, values in zip(base, ROWS, strict=True):
        row.update(values)
        row["created_at"] = datetime(2026, 1, 1 + row["policy_version"], tzinfo=UTC)
    path = tmp_path / "samples"
    write_deltalake(path, pa.Table.from_pylist(base, schema=SAMPLE_SCHEMA))
    return DeltaTable(path)


def selected(table: DeltaTable, text: str, also: str | None = None) -> list[int]:
    """Indices into ROWS of the rows the filter keeps (row i has sample id q_i_0)."""
    rows = select_where(table, text, SAMPLE_SCHEMA, also=also)
    assert rows.schema == SAMPLE_SCHEMA
    return sorted(int(sid.split("_")[1]) for sid in rows["sample_id"].to_pylist())


@pytest.mark.parametrize(("text", "expected"), [
    ("reward > 0", [0, 3]),
    ("reward >= 0 and node == 'solver'", [0, 1]),
    ("node = 'verifier' or policy_version < 1", [0, 2, 3]),
    ("not (node == 'solver') and reward is not null", [3]),
    ("reward is null", [2]),
    ("policy_version in (0, 2)", [0, 3]),
    ("node not in ('verifier')", [0, 1]),
    ("reward > 0.25 AND Not finish_reason != 'stop'", [0, 3]),  # keywords in any case
    ("parsed == 'it''s'", [3]),  # a quote inside text, written twice as in SQL
    ("reward > 1e-3 or policy_version <> 1", [0, 3]),
    ("created_at >= '2026-01-02T00:00:00+00:00' and reward is not null", [1, 3]),
    ("(reward > 0 or reward is null) and policy_version > 0", [2, 3]),
    ("reward >= advantage", [0, 3]),  # two columns of one kind
    ("reward > -1\n  and node == 'solver'", [0, 1]),  # a negative number; a filter over lines
])
def test_filters_select_the_rows_they_describe(table: DeltaTable, text: str, expected: list[int]) -> None:
    assert selected(table, text) == expected


def test_our_own_condition_is_anded_with_the_filter(table: DeltaTable) -> None:
    assert selected(table, "reward > 0 or parsed is null", also="policy_version = 1") == [1]


@pytest.mark.parametrize(("text", "message"), [
    ("rewrd > 0", "unknown column 'rewrd' (did you mean 'reward'?)"),
    ("prompt_ids > 3", "column 'prompt_ids' holds lists"),
    ("reward > 'high'", "'reward' holds number values but 'high' is text; e.g. reward > 0"),
    ("node == solver", "expected a value to compare 'node' with (quote text: node == 'solver')"),
    ("node == 3", "'node' holds text values but 3 is number; e.g. node == 'solver'"),
    ("3 == node", "'node' holds text values but 3 is number"),
    ("node in ('solver', 3)", "'node' holds text values but 3 is number"),
    ("node == reward", "'node' holds text values but 'reward' holds number values"),
    ("turn == true", "'turn' holds number values but true is bool"),
    ("reward == null", "expected a value to compare 'reward' with, found 'null' (use: reward is null)"),
    ("reward >", "expected a value to compare 'reward' with, found the end"),
    ("(reward > 0", "expected ), found the end"),  # from here on, DataFusion's parser, reworded
    ("reward > 0 reward < 1", "expected 'and', 'or' or the end of the filter, found 'reward'"),
    ("reward is 0", "after IS, found '0'"),
    ("reward > 0 and", "expected an expression, found the end"),
    ("reward", "the filter is not a condition over the table: Cannot create filter with non-boolean predicate"),
    ("created_at > 'yesterday'", "'created_at' is a timestamp: give an ISO 8601 time"),
    ("node = \"verifier\"", "unexpected character '\"' (text goes in single quotes"),
    ("node == 'solver", "text is not closed; a quote inside text is written twice"),
    ("   ", "the filter is empty"),
])
def test_bad_filters_are_refused_with_the_problem_named(table: DeltaTable, text: str, message: str) -> None:
    with pytest.raises(FilterError) as err:
        select_where(table, text, SAMPLE_SCHEMA)
    assert message in str(err.value)


@pytest.mark.parametrize(("text", "message"), [
    ("reward > 0; drop table t", "unexpected character ';'"),
    ("reward > 0 union all select * from t", "unexpected character '*'"),
    ("reward > 0 union all select sample_id from t", "unknown column 'union'"),
    ("reward > 0 limit 0", "unknown column 'limit'"),
    ("reward > 0 -- the rest is a comment", "unexpected character '-'"),
    ("reward > 0 /* a comment */", "unexpected character '/'"),
    ("node in (select node from t)", "unknown column 'select'"),
    ("'a' == 'a' or read_parquet('/etc/passwd') is null", "unknown column 'read_parquet'"),
    ("cast(node as int) > 0", "unknown column 'cast'"),
    ("node::int > 0", "unexpected character ':'"),
    ("__import__('os')", "unknown column '__import__'"),
    ("reward.__class__ > 0", "unexpected character '.'"),
])
def test_hostile_filters_never_reach_datafusion(table: DeltaTable, text: str, message: str) -> None:
    """Each is refused by the allow-list scan; several are SQL that DataFusion would run (a union, a limit)."""
    with pytest.raises(FilterError) as err:
        select_where(table, text, SAMPLE_SCHEMA)
    assert message in str(err.value)


def test_an_unknown_column_lists_every_column_a_filter_may_use(table: DeltaTable) -> None:
    with pytest.raises(FilterError) as err:
        select_where(table, "score > 1", SAMPLE_SCHEMA)
    listed = str(err.value).split("valid columns: ")[1].split(", ")
    assert listed == filter_columns(SAMPLE_SCHEMA)
    assert "reward" in listed and "policy_version" in listed and "prompt_ids" not in listed
    # the caret points at the column
    lines = str(err.value).splitlines()
    assert lines[1].strip() == "score > 1" and lines[2].index("^") == lines[1].index("s")


def test_datafusion_positions_point_into_the_filter(table: DeltaTable) -> None:
    for text in ("reward > 0 reward < 1", "reward > 0 and\n  turn > 0 turn < 1"):
        with pytest.raises(FilterError) as err:
            select_where(table, text, SAMPLE_SCHEMA)
        shown, caret = str(err.value).splitlines()[1:3]
        assert shown[caret.index("^"):].startswith(text.split()[-3])  # the second 'reward' / 'turn'
