"""`flexmarl store inspect | verify | export` as a user runs them: real processes, exit codes, files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from flexmarl.bench.store_bench import synthetic_samples
from storage.store import ExperienceStore

ROOT = Path(__file__).resolve().parents[2]


def flexmarl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "store", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    store = ExperienceStore(tmp_path / "run" / "store")
    store.create(["solver"])
    rng = np.random.default_rng(0)
    for k in range(3):
        rows = synthetic_samples(8 * k, 8, policy_version=k, prompt_len=4, response_len=4, rng=rng)
        store.append_samples("solver", rows, app_id="rollout:solver", seq=k + 1)
    for v in (1, 2):
        ids = store.read_samples("solver", policy_version=v - 1)["sample_id"].to_pylist()
        store.record_update("solver", v, ids, samples_version=v, num_tokens=32)
    return tmp_path / "run"


def test_verify_exits_0_on_a_clean_store_and_1_naming_a_duplicate(run_dir: Path) -> None:
    ok = flexmarl("verify", str(run_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "no violations" in ok.stdout

    store = ExperienceStore(run_dir / "store")
    again = store.read_samples("solver", policy_version=2).slice(0, 1)  # a row appended a second time
    write_deltalake(store.table_uri("samples/solver"), again, mode="append")
    bad = flexmarl("verify", str(run_dir))
    assert bad.returncode == 1
    assert "duplicate" in bad.stdout and "samples/solver" in bad.stdout
    assert again["sample_id"][0].as_py() in bad.stdout

    report = json.loads(flexmarl("verify", str(run_dir), "--json").stdout)
    assert report["ok"] is False
    assert [(v["check"], v["table"], v["ids"]) for v in report["violations"]] == [
        ("duplicate", "samples/solver", [again["sample_id"][0].as_py()])
    ]


def test_verify_refuses_a_path_that_is_not_a_store(tmp_path: Path) -> None:
    res = flexmarl("verify", str(tmp_path / "nowhere"))
    assert res.returncode == 2 and "neither a run directory nor a store" in res.stderr


def test_inspect_json_lists_files_and_bytes(run_dir: Path) -> None:
    res = flexmarl("inspect", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    solver = json.loads(res.stdout)["tables"]["samples/solver"]
    assert solver["rows"] == 24 and solver["files"] == 3 and solver["bytes"] > 0


def test_export_writes_the_rows_of_one_policy_version(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "v1.parquet"
    res = flexmarl("export", str(run_dir), "--agent", "solver", "--version", "1", "--format", "parquet",
                   "--out", str(out))
    assert res.returncode == 0, res.stderr
    table = pq.read_table(out)
    assert table.num_rows == 8 and set(table["policy_version"].to_pylist()) == {1}
    assert table["sample_id"].to_pylist() == sorted(table["sample_id"].to_pylist())

    unknown = flexmarl("export", str(run_dir), "--agent", "planner", "--out", str(out))
    assert unknown.returncode == 2 and "no agent 'planner'" in unknown.stderr and "solver" in unknown.stderr
