"""The `flexmarl` command line as a user runs it: real processes, a Prefect server the run starts itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from flexmarl.models.loading import load_model, resolve_model
from flexmarl.training.state import tensor_bytes

FLEXMARL = [sys.executable, "-m", "flows.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the run's own server keeps its database here
    return subprocess.run(FLEXMARL + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_validate_accepts_a_good_config_and_rejects_a_cycle(tmp_path: Path) -> None:
    from importlib import resources

    raw = yaml.safe_load(resources.files("flexmarl.presets").joinpath("tiny.yaml").read_text())
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(raw))
    ok = run(["validate", str(good)], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "valid" in ok.stdout

    raw["graph"]["edges"].append(["verifier", "solver"])
    bad = tmp_path / "cyclic.yaml"
    bad.write_text(yaml.safe_dump(raw))
    res = run(["validate", str(bad)], tmp_path)
    assert res.returncode == 2
    assert "cycle" in res.stderr and "cyclic.yaml" in res.stderr
    # the fix is printed whole: brackets in the message are not taken for console markup
    assert "graph.loops like {nodes: [solver, verifier], max_turns: 3}" in " ".join(res.stderr.split())


def test_train_tiny_from_the_command_line_then_inspect_the_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = run(["train", "--preset", "tiny", "--run-dir", str(run_dir), "--set", "run.queries_per_step=2"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "solver v2 |" in res.stdout + res.stderr  # the per-update progress lines
    report = json.loads((run_dir / "report.json").read_text())

    res = run(["store", "inspect", str(run_dir), "--json"], tmp_path)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    for agent, a in report["agents"].items():
        assert a["updates"] == 2
        assert info["agents"][agent]["rows"] == a["samples_generated"]
        half = a["samples_generated"] // 2
        assert info["agents"][agent]["by_version"] == {"0": half, "1": half}
        assert info["tables"][f"samples/{agent}"]["rows"] == a["samples_generated"]
        # each update's weights reached the agent's replicas: at least one whole model's bytes, timed
        sync = a["weight_sync"]
        assert sync["replica_syncs"] >= 1 and sync["seconds_per_update"] > 0, sync
        assert sync["in_place_syncs"] >= 1, sync  # the replica beside its trainer loads from it, not from a copy
        assert sync["bytes_per_update"] >= tensor_bytes(load_model(resolve_model("tiny")).state_dict()), sync

    # the run's store holds every invariant (unique ids, contiguous versions, on-policy consumption, parents)
    res = run(["store", "verify", str(run_dir)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no violations" in res.stdout
