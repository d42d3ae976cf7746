"""`flexmarl bench pipeline`: rounds interleave the modes, and the report gives medians, spreads and bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.bench.pipeline_bench import (
    SMOLLM2, bench_pipeline, generation_by_batch, spread, work_bound, work_split, workload_config,
)
from flexmarl.cluster.config import ClusterConfig
from flexmarl.config import ConfigError, load_config
from flexmarl.models.loading import load_model, resolve_model
from flexmarl.orchestrator.records import PipelineResult, Span
from flexmarl.run.layout import STATE_DIR, STORE_DIR


def test_the_work_bound_spreads_the_work_over_workers_and_keeps_each_agents_training_serial() -> None:
    spans = [Span("w1", "rollout", "a", 0, 4), Span("w2", "rollout", "b", 0, 2), Span("w1", "train", "a", 4, 5),
             Span("w2", "sync", "b", 2, 3), Span("w2", "swap", "b", 3, 4),  # the schedule's overhead: not work
             Span("w1", "snapshot", "a", 5, 6)]
    assert work_bound(PipelineResult(0.0, 10.0, spans, [], ["w1", "w2"], 0)) == 3.5  # (4 + 2 + 1) / 2 workers
    one_agent = [Span("w1", "train", "a", 0, 6), Span("w2", "rollout", "b", 0, 1)]
    assert work_bound(PipelineResult(0.0, 10.0, one_agent, [], ["w1", "w2"], 0)) == 6.0  # a's training is serial
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_generation_is_split_by_agent_and_batch_size_from_the_rollout_spans() -> None:
    spans = [Span("w1", "rollout", "a", 0, 4, requests=8, tokens=100),
             Span("w2", "rollout", "a", 0, 2, requests=8, tokens=60),
             Span("w2", "rollout", "b", 2, 3, requests=2, tokens=40), Span("w1", "train", "a", 4, 9),
             Span("w2", "swap", "b", 3, 4, background=True), Span("w2", "train", "b", 5, 6, background=True)]
    result = PipelineResult(0.0, 10.0, spans, [], ["w1", "w2"], 0)
    assert generation_by_batch(result) == {"a": {8: {"batches": 2, "seconds": 6.0, "tokens": 160}},
                                           "b": {2: {"batches": 1, "seconds": 1.0, "tokens": 40}}}
    split = work_split(result)
    assert split["generation_s"] == 7.0 and split["training_s"] == 5.0  # a background span is no work
    assert split["batches"] == 3 and split["mean_batch"] == 6.0 and split["ms_per_token"] == pytest.approx(35.0)


@pytest.mark.cluster
def test_rounds_interleave_the_modes_and_the_report_gives_medians_and_spreads(tmp_path: Path) -> None:
    order: list[str] = []
    after_round_1: dict = {}

    def log(line: str) -> None:
        order.append(line)
        if line.startswith("round 2/2, mode sync"):  # a bench stopped from here on keeps round 1's figures
            after_round_1.update(json.loads((tmp_path / "bench.json").read_text()))

    report = bench_pipeline(out_dir=tmp_path, modes=["sync", "flexmarl"], steps=1, workload="tiny", repeats=2,
                            overrides=["agents.verifier.adapter={r: 4}"],  # beside the full-model solver
                            cluster=ClusterConfig(n_workers=2), log=log)
    assert after_round_1["rounds_done"] == 1 and after_round_1["weights_match_sync"]
    assert all(len(after_round_1["modes"][m]["rounds"]) == 1 for m in ("sync", "flexmarl"))
    assert [line.split(":")[0] for line in order if line.startswith("round")] == [
        "round 1/2, mode sync", "round 1/2, mode flexmarl", "round 2/2, mode sync", "round 2/2, mode flexmarl"]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["repeats"] == 2 and saved["weights_match_sync"]
    for mode in ("sync", "flexmarl"):
        r = saved["modes"][mode]
        assert len(r["rounds"]) == 2
        walls = sorted(run["wall_s"] for run in r["rounds"])
        assert r["wall_s"] == pytest.approx(sum(walls) / 2) and r["wall_s_spread"]["min"] == walls[0]
        assert 0 < r["efficiency"] <= 1.0 + 1e-9 and r["bound_s"] <= r["wall_s"] + 1e-9
        # a sync carries the solver's whole model (float32) and the adapter agent's adapter only
        full = 4 * sum(t.numel() for t in load_model(resolve_model("tiny")).state_dict().values())
        assert r["sync_bytes_per_update"]["solver"] == full, (r["sync_bytes_per_update"], full)
        assert 0 < r["sync_bytes_per_update"]["verifier"] < full / 5
        assert r["peak_rss_per_worker_bytes"] >= max(run["peak_rss_bytes"] for run in r["rounds"]) > 100e6
        # the driver loop waits on the workers for some of the time, and works for some of it
        assert all(0 < run["driver_busy_share"] < 1 for run in r["rounds"]), r["rounds"]
        assert all(len(run["driver_busy_by_step"]) == 1 and 0 < run["driver_busy_by_step"][0] < 1
                   for run in r["rounds"]), r["rounds"]
        # each agent's one update wrote its state (the last version always is), on the worker's clock
        assert r["snapshots"]["count"] == 2 and 0 < r["snapshots"]["share"] < 1, r["snapshots"]
        assert 0 < r["snapshot_share"] < 1
        # each agent's one update was synced to its replica, on a worker's clock
        for agent, sync in r["weight_sync"].items():  # every replica of the agent took its whole update
            assert sync["replica_syncs"] >= 1 and sync["seconds_per_update"] > 0, sync
            replicas = sync["bytes_per_update"] / r["sync_bytes_per_update"][agent]
            assert replicas >= 1 and replicas == int(replicas), (sync, r["sync_bytes_per_update"])
    ratios = [s["wall_s"] / f["wall_s"] for s, f in zip(saved["modes"]["sync"]["rounds"],
                                                         saved["modes"]["flexmarl"]["rounds"], strict=True)]
    assert saved["speedup_vs_sync"]["flexmarl"]["min"] == pytest.approx(min(ratios))
    assert saved["speedup_vs_sync"]["sync"]["median"] == 1.0
    # the speedup splits into how well the mode packs its work and what that work cost against sync's
    gains = [f["efficiency"] / s["efficiency"] * s["bound_s"] / f["bound_s"]
             for s, f in zip(saved["modes"]["sync"]["rounds"], saved["modes"]["flexmarl"]["rounds"], strict=True)]
    assert gains == pytest.approx(ratios)
    assert saved["schedule_gain_vs_sync"]["sync"]["median"] == saved["work_ratio_vs_sync"]["sync"]["median"] == 1.0
    assert saved["schedule_gain_vs_sync"]["flexmarl"]["min"] == pytest.approx(
        min(f["efficiency"] / s["efficiency"] for s, f in zip(saved["modes"]["sync"]["rounds"],
                                                              saved["modes"]["flexmarl"]["rounds"], strict=True)))
    # a perfect schedule of a mode's own work is never slower than the mode
    for mode in ("sync", "flexmarl"):
        assert saved["bound_speedup_vs_sync"][mode]["min"] >= saved["speedup_vs_sync"][mode]["min"] - 1e-9
        r = saved["modes"][mode]
        assert r["generation_s"] > 0 and r["training_s"] > 0 and r["mean_batch"] >= 1
        batches = r["generation_by_batch"]
        assert set(batches) == {"solver", "verifier"} and all(int(n) >= 1 for rows in batches.values() for n in rows)
        # every sample generated in the last round is in one of its batches
        assert sum(int(n) * row["batches"] for rows in batches.values() for n, row in rows.items()) == r["samples"]
    assert "efficiency" in (tmp_path / "report.md").read_text() and (tmp_path / "timeline_flexmarl.png").is_file()
    assert report["modes"]["flexmarl"]["per_agent"]
    # a mode's training states are dropped once its weights are compared; its store stays for inspection
    assert not (tmp_path / "flexmarl" / STATE_DIR).exists() and (tmp_path / "flexmarl" / STORE_DIR).is_dir()


def test_the_real_model_fan_out_is_the_fan_out_preset_with_smollm2_agents() -> None:
    cfg = workload_config("fan_out_smollm2", ["run.steps=2"])
    preset = load_config(preset="fan_out")
    assert {a: s.model for a, s in cfg.agents.items()} == dict.fromkeys(preset.agents, SMOLLM2)
    assert cfg.graph.model_dump() == preset.graph.model_dump() and cfg.run.steps == 2
    with pytest.raises(ConfigError, match="unknown workload 'fan_out_smolm2'.*fan_out_smollm2"):
        workload_config("fan_out_smolm2")
