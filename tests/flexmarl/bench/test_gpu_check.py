"""The GPU check (``flexmarl.bench.gpu_check``) on this CPU at smoke size: every section runs and reports what the
docs quote from a lent GPU, and a failing section leaves the others' figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flexmarl.bench import gpu_check
from flexmarl.models.loading import resolve_model

# SmolLM2 and Qwen2-sized models: its fixture alone converts SmolLM2 (~15 s), and the full check trains on a cluster
pytestmark = pytest.mark.cluster

MODELS = ("smollm2-135m", "qwen2-0.5b")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2-135m-instruct")


def test_every_section_reports_on_cpu_at_smoke_size(tmp_path: Path, smollm2: Path) -> None:
    out = tmp_path / "out"
    report = gpu_check.run(out, smollm2, work_dir=tmp_path / "work", smoke=True, pipeline_repeats=1)
    name = gpu_check.report_name("cpu")
    assert json.loads((out / name).read_text()) == json.loads(json.dumps(report, default=str))
    failed = {s: report[s]["traceback"] for s in gpu_check.SECTIONS if "error" in report[s]}
    assert not failed, failed
    for model in MODELS:
        rows = report["rollout"][model]
        assert set(rows) == {str(b) for b in gpu_check.SMOKE_BATCHES}
        assert all(r["hf"]["tokens_per_s"] > 0 and r["hf"]["batch"] == int(b) for b, r in rows.items())
        for r in rows.values():  # beside plain generate and the roofline, each as a share of the roofline
            assert r["generate"]["tokens_per_s"] > 0 and r["limit"]["tokens_per_s"] > 0
            assert r["hf"]["share_of_limit"] == r["hf"]["tokens_per_s"] / r["limit"]["tokens_per_s"]
        training = report["training"][model]
        assert training["tokens_per_s"] > 0 and 0 < training["mfu"] < 1
        sync = report["weight_sync"][model]
        assert sync["bytes"] > 0 and sync["to_host_s"] > 0 and sync["load_s"] > 0 and sync["in_place_s"] > 0
    for b in gpu_check.SMOKE_BATCHES:  # every decode step at every batch (compiled where a compiler is here)
        rows = report["decode"][str(b)]
        assert set(rows) == set(gpu_check.DECODES), rows
        measured = [m for m in gpu_check.DECODES if m != "compiled" or shutil.which("c++")]
        assert all(rows[m]["tokens_per_s"] > 0 and rows[m]["decode"] == m for m in measured), rows
    # the adapter agent's state is a small part of its model's
    swap = report["swap"]
    assert all(s["bit_exact"] for s in swap.values())
    assert swap["smollm2-135m-lora-r8"]["state_bytes"] < swap["smollm2-135m"]["state_bytes"] / 5
    pipeline = report["pipeline"]
    assert pipeline["weights_match_sync"] and set(pipeline["modes"]) == {"sync", "flexmarl"}
    # out keeps the JSON and the pictures; models and run directories stay in the work directory
    assert sorted(p.name for p in out.iterdir()) == [name, "timeline_flexmarl.png", "timeline_sync.png"]


def test_a_failing_section_is_recorded_and_the_next_still_runs(
    tmp_path: Path, smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(models: dict, smoke: bool) -> dict:
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(gpu_check, "swap", broken)
    report = gpu_check.run(tmp_path / "out", smollm2, smoke=True, sections=("swap", "weight_sync"))
    assert report["swap"]["error"] == "RuntimeError: no pinned memory"
    assert set(report["weight_sync"]) == set(MODELS) and set(report["seconds"]) == {"swap", "weight_sync"}


def test_the_report_is_named_after_the_gpu_and_the_day() -> None:
    assert gpu_check.report_name("NVIDIA H100 80GB HBM3", "2026-12-06") == "gpu_check_h100_2026-12-06.json"
    assert gpu_check.report_name("NVIDIA H200", "2026-12-04") == "gpu_check_h200_2026-12-04.json"
    assert gpu_check.report_name("cpu", "2026-12-06") == "gpu_check_cpu_2026-12-06.json"
