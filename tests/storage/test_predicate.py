"""--where filters: what they select, and what they refuse (never evaluated as Python)."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest

from storage.predicate import PredicateError, parse_where, scalar_columns
from storage.schema import SAMPLE_SCHEMA

ROWS = [
    {"node": "solver", "reward": 1.0, "policy_version": 0, "parsed": "7", "finish_reason": "stop"},
    {"node": "solver", "reward": 0.0, "policy_version": 1, "parsed": None, "finish_reason": "length"},
    {"node": "verifier", "reward": None, "policy_version": 1, "parsed": "1", "finish_reason": "stop"},
    {"node": "verifier", "reward": 0.5, "policy_version": 2, "parsed": "it's", "finish_reason": "stop"},
]


@pytest.fixture
def table(make_rows) -> pa.Table:
    base = make_rows("solver", [f"q_{i}_0" for i in range(len(ROWS))]).to_pylist()
    for row, values in zip(base, ROWS, strict=True):
        row.update(values)
        row["created_at"] = datetime(2026, 1, 1 + row["policy_version"], tzinfo=UTC)
    return pa.Table.from_pylist(base, schema=SAMPLE_SCHEMA)


def selected(table: pa.Table, text: str) -> list[int]:
    """Indices into ROWS of the rows the filter keeps (row i has sample id q_i_0)."""
    return [int(sid.split("_")[1]) for sid in table.filter(parse_where(text, SAMPLE_SCHEMA))["sample_id"].to_pylist()]


@pytest.mark.parametrize(("text", "expected"), [
    ("reward > 0", [0, 3]),
    ("reward >= 0 and node == 'solver'", [0, 1]),
    ("node = \"verifier\" or policy_version < 1", [0, 2, 3]),
    ("not (node == 'solver') and reward is not null", [3]),
    ("reward is null", [2]),
    ("policy_version in (0, 2)", [0, 3]),
    ("node not in ('verifier')", [0, 1]),
    ("reward > 0.25 AND Not finish_reason != 'stop'", [0, 3]),  # keywords in any case
    ("parsed == 'it\\'s'", [3]),  # an escaped quote inside a text literal
    ("reward > 1e-3 or policy_version <> 1", [0, 3]),
    ("created_at >= '2026-01-02T00:00:00+00:00' and reward is not null", [1, 3]),
    ("(reward > 0 or reward is null) and policy_version > 0", [2, 3]),
])
def test_filters_select_the_rows_they_describe(table: pa.Table, text: str, expected: list[int]) -> None:
    assert sorted(selected(table, text)) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("rewrd > 0", "unknown column 'rewrd' (did you mean 'reward'?)"),
    ("prompt_ids > 3", "column 'prompt_ids' holds lists"),
    ("reward > 'high'", "'reward' holds number values but 'high' is text; e.g. reward > 0"),
    ("node == solver", "expected a value to compare 'node' with (quote text: node == 'solver')"),
    ("node == 3", "'node' holds text values but 3 is number; e.g. node == 'solver'"),
    ("reward >", "expected a value to compare 'reward' with, found the end"),
    ("(reward > 0", "expected ')', found the end"),
    ("reward > 0 reward < 1", "expected 'and', 'or' or the end of the filter, found 'reward'"),
    ("reward is 0", "expected 'null' after 'is'"),
    ("created_at > 'yesterday'", "'created_at' is a timestamp: give an ISO 8601 time"),
    ("reward > 0; import os", "unexpected character ';'"),
    ("__import__('os')", "unknown column '__import__'"),
    ("reward.__class__ > 0", "unexpected character '.'"),
    ("   ", "the filter is empty"),
])
def test_bad_filters_are_refused_with_the_problem_named(text: str, message: str) -> None:
    with pytest.raises(PredicateError) as err:
        parse_where(text, SAMPLE_SCHEMA)
    assert message in str(err.value)


def test_an_unknown_column_lists_every_column_a_filter_may_use() -> None:
    with pytest.raises(PredicateError) as err:
        parse_where("score > 1", SAMPLE_SCHEMA)
    listed = str(err.value).split("valid columns: ")[1].split(", ")
    assert listed == scalar_columns(SAMPLE_SCHEMA)
    assert "reward" in listed and "policy_version" in listed and "prompt_ids" not in listed
    # the caret points at the column
    lines = str(err.value).splitlines()
    assert lines[1].strip() == "score > 1" and lines[2].index("^") == lines[1].index("s")
