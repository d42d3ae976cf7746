"""`flexmarl store query` on a real tiny run: decoded text, --where, --episode, and clear refusals."""

from __future__ import annotations

import json

import pyarrow.compute as pc
from deltalake import DeltaTable
from transformers import AutoTokenizer
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def query(tiny_run, *args: str) -> list[dict]:
    res = runner.invoke(app, ["store", "query", str(tiny_run.run_dir), *args, "--format", "jsonl"])
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.output.splitlines()]


def test_jsonl_rows_carry_the_decoded_prompt_and_response(tiny_run) -> None:
    stored = DeltaTable(str(tiny_run.run_dir / "store" / "samples" / "verifier")).to_pyarrow_table()
    tok = AutoTokenizer.from_pretrained(tiny_run.run_dir / "checkpoints" / "verifier" / "v2")
    rows = query(tiny_run, "--agent", "verifier", "--limit", "0")
    assert len(rows) == stored.num_rows
    by_id = {r["sample_id"]: r for r in stored.to_pylist()}
    for row in rows:
        raw = by_id[row["sample_id"]]
        assert row["prompt"] == tok.decode(raw["prompt_ids"])
        assert row["response"] == tok.decode(raw["response_ids"], skip_special_tokens=True)
        assert row["reward"] == raw["reward"] and "prompt_ids" not in row
    assert [(r["step"], r["episode_id"]) for r in rows] == sorted((r["step"], r["episode_id"]) for r in rows)
    assert len(query(tiny_run, "--agent", "verifier", "--limit", "3")) == 3


def test_where_and_version_select_what_they_say(tiny_run) -> None:
    stored = DeltaTable(str(tiny_run.run_dir / "store" / "samples" / "solver")).to_pyarrow_table()
    want = stored.filter((pc.field("policy_version") == 1) & ((pc.field("reward") > 0) | pc.field("parsed").is_null()))
    rows = query(tiny_run, "--agent", "solver", "--version", "1", "--where", "reward > 0 or parsed is null",
                 "--limit", "0")
    assert sorted(r["sample_id"] for r in rows) == sorted(want["sample_id"].to_pylist())

    res = runner.invoke(app, ["store", "query", str(tiny_run.run_dir), "--agent", "solver", "--where", "score > 0"])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "unknown column 'score'" in text and "valid columns: sample_id, episode_id" in text


def test_an_episode_shows_every_agent_in_graph_order(tiny_run) -> None:
    episode = query(tiny_run, "--agent", "verifier", "--limit", "1")[0]["episode_id"]
    rows = query(tiny_run, "--episode", episode)
    assert [(r["agent"], r["turn"]) for r in rows] == [("solver", 0), ("verifier", 1)]
    # the verifier was shown the solver's answer: the graph's data dependency, in plain text
    assert rows[1]["parent_ids"] == [rows[0]["sample_id"]]
    assert rows[0]["response"].strip()[:8] in rows[1]["prompt"]

    res = runner.invoke(app, ["store", "query", str(tiny_run.run_dir), "--episode", episode], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert f"episode {episode}" in res.output and "outcome completed" in res.output

    both = runner.invoke(app, ["store", "query", str(tiny_run.run_dir), "--agent", "solver", "--episode", episode])
    assert both.exit_code == 2 and "exactly one" in both.output
