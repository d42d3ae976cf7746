"""`bench rollout`: the three ways sample the same episodes, and only the balanced one moves slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.bench.rollout_bench import WAYS, bench_rollout
from storage.store import ExperienceStore


@pytest.mark.cluster
def test_rollout_bench_compares_like_with_like(tmp_path: Path) -> None:
    report = bench_rollout(out_dir=tmp_path, repeats=1, log=lambda _: None)
    assert json.loads((tmp_path / "bench_rollout.json").read_text()) == json.loads(json.dumps(report))
    dp, lb = report["dependency_parallel"], report["balancing"]
    assert dp["speedup"] == dp["layered_s"] / dp["dependency_s"]
    assert lb["with_lb"]["capacity_moves"] > 0 and lb["without_lb"]["capacity_moves"] == 0
    assert len(lb["moves"]) == lb["with_lb"]["capacity_moves"]
    assert report["backends"]["hf"]["tokens_per_s"] > 0
    vllm = report["backends"]["vllm"]
    assert "tokens_per_s" in vllm or "make setup-vllm" in vllm["unavailable"]
    # the same seeded requests: every way generated exactly the same samples
    samples = {
        way: {a: ExperienceStore(tmp_path / "runs" / f"{way}-0" / "store")
              .read_samples(a, columns=["sample_id", "response_ids"]).sort_by("sample_id").to_pylist()
              for a in ("planner", "solver", "aggregator")}
        for way in WAYS
    }
    assert samples["layered"] == samples["dependency"] == samples["without_lb"]
    assert len(samples["layered"]["solver"]) == 3 * report["episodes"]
    for way in WAYS:
        assert (tmp_path / f"queues_{way}.png").stat().st_size > 0
