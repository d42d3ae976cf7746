"""`flexmarl bench chaos` end to end with one fault, and its seeded schedule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexmarl.bench.chaos_bench import KINDS, schedule

ROOT = Path(__file__).resolve().parents[2]


def test_the_schedule_is_seeded_and_each_round_holds_every_kind() -> None:
    assert schedule(6, seed=3) == schedule(6, seed=3)
    assert schedule(8, seed=0) != schedule(8, seed=1)
    assert sorted(schedule(4, seed=5)) == sorted(KINDS) == sorted(schedule(8, seed=5)[4:])


def test_bench_chaos_kills_the_driver_resumes_and_reports_an_exact_run(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    assert schedule(1, seed=0) == ["driver_kill"]  # the fault this test exercises
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "bench", "chaos", "--out", str(out), "--faults", "1", "--seed", "0",
         "--set", "run.steps=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    assert (report["faults_injected"], report["runs_completed"]) == (1, 1)
    assert (report["samples_lost"], report["samples_duplicated"], report["prompts_skipped"]) == (0, 0, 0)
    assert report["weights_match_uninterrupted"] and report["stores_verified"]
    [fault] = report["faults"]
    assert fault["kind"] == "driver_kill" and fault["at"].startswith("after sample commit ")
    assert fault["recovered_s"] > 0
    assert report["runs"][0]["samples_reused"] > 0  # the resumed driver took over the committed samples
