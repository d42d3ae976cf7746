"""The store benchmark at a tiny size: the report's shape only (speed is never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexmarl.bench.store_bench import run_store_bench, synthetic_samples
from storage.schema import SAMPLE_SCHEMA

ROOT = Path(__file__).resolve().parents[3]
LATENCY_KEYS = {"n", "p50_ms", "p99_ms", "mean_ms", "max_ms"}


def test_synthetic_samples_match_the_schema() -> None:
    import numpy as np

    rows = synthetic_samples(0, 16, policy_version=2, prompt_len=5, response_len=3, rng=np.random.default_rng(0))
    assert rows.schema.equals(SAMPLE_SCHEMA) and rows.num_rows == 16
    assert len(set(rows["sample_id"].to_pylist())) == 16
    assert {len(r) for r in rows["logprobs"].to_pylist()} == {3}


def test_tiny_bench_reports_both_stores(tmp_path: Path) -> None:
    report = run_store_bench(tmp_path, commits=20, rows_per_commit=8, compact_after_files=5, reads=4,
                             batches_per_version=4, prompt_len=8, response_len=8)
    assert set(report) == {"config", "append", "read", "summary"}
    for name in ("no_compaction", "auto_compaction"):
        append = report["append"][name]
        assert set(append["latency"]) == LATENCY_KEYS and append["latency"]["n"] == 20
        assert append["final_rows"] == 20 * 8
        assert report["read"][name]["latency"]["n"] == 4
        assert report["read"][name]["rows_served"] == 4 * 8
    assert report["append"]["no_compaction"]["compactions"] == 0
    assert report["append"]["auto_compaction"]["compactions"] >= 1
    assert report["append"]["auto_compaction"]["final_files"] < 5
    assert list(tmp_path.iterdir()) == []  # the scratch stores are removed


def test_bench_store_command_writes_the_json(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "bench", "store", "--out", str(tmp_path), "--commits", "6",
         "--rows-per-commit", "4", "--compact-after-files", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "bench_store.json").read_text())
    assert report["config"]["commits"] == 6
    assert set(report["summary"]) == {"append_p50_ms", "append_p99_ms", "rows_per_s", "read_p50_ms", "read_p99_ms"}
