"""Experiments: the sim.json report, the paper comparison, sweeps and the scale case on a small size."""

from __future__ import annotations

import json

import pytest

from flexmarl.sim.engine import simulate
from flexmarl.sim.experiments import preset_with_agents, preset_with_devices, run_preset, run_sweep


def test_report_has_every_mode_and_the_papers_ratios_beside_ours(small, tmp_path) -> None:
    report = run_preset(small, ["sync", "flexmarl", "no-lb", "no-pipeline"], out_dir=tmp_path)
    saved = json.loads((tmp_path / "sim.json").read_text())
    assert saved["preset"] == "small" and saved["devices"] == 8 and saved["agents"] == 3
    assert set(saved["modes"]) == {"sync", "flexmarl", "no-lb", "no-pipeline"}
    for r in saved["modes"].values():
        assert r["step_s"] > 0 and 0 < r["utilization"] <= 1 and r["tokens_per_s"] > 0
    assert saved["paper"] == {"speedup_vs_marti": 2.0, "lb_ablation": 1.2, "pipeline_ablation": 1.6}
    flex = saved["modes"]["flexmarl"]["step_s"]
    assert saved["ours"]["lb_ablation"] == pytest.approx(saved["modes"]["no-lb"]["step_s"] / flex)
    assert saved["speedup_vs_sync"]["sync"] == 1.0
    assert report["sim_wall_s"] > 0 and (tmp_path / "timeline_flexmarl.png").stat().st_size > 0


def test_unknown_modes_are_refused(small) -> None:
    with pytest.raises(ValueError, match="unknown modes \\['fast'\\]"):
        run_preset(small, ["flexmarl", "fast"])


def test_sweep_presets_grow_the_work_and_the_cluster() -> None:
    sizes = [len(preset_with_agents(n).expanded.nodes) for n in (2, 4, 16)]
    assert sizes == [2, 9, 24]  # router and summariser, plus specialists with fan-out 4, 3, 2, 2, 2, then 1
    assert len(preset_with_agents(16).agents) == 16
    small, big = preset_with_devices(64), preset_with_devices(8192)
    assert (small.cluster.total_devices, big.cluster.total_devices) == (64, 8192)
    assert small.cluster.layout.devices == 64 and big.cluster.layout.devices == 8192
    with pytest.raises(ValueError, match="multiple of 16"):
        preset_with_devices(100)


def test_fifteen_agents_on_a_small_cluster_all_train_every_step() -> None:
    preset = preset_with_devices(128)  # 15 agents, 2 training slots: states swap and move between slots
    result = simulate(preset, "flexmarl", steps=3)
    assert sorted((u.agent, u.step) for u in result.updates) == sorted(
        (a, s) for a in preset.agents for s in range(3))
    assert (result.span_kind == 2).any()  # swaps: more agents than training slots


def test_sweep_writes_points_and_a_picture(tmp_path) -> None:
    report = run_sweep("agents", modes=["flexmarl"], steps=2, values=(2, 4), out_dir=tmp_path)
    assert [p["agents"] for p in report["points"]] == [2, 4]
    assert json.loads((tmp_path / "sweep_agents.json").read_text())["points"][1]["modes"]["flexmarl"]["step_s"] > 0
    assert (tmp_path / "sweep_agents.png").stat().st_size > 0
