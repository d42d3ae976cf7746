"""`flexmarl simulate`: writes sim.json for a preset; bad input exits 2 with the problem named."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flows.cli import app

SMALL = """
name: cli-small
description: two agents
cluster:
  nodes: 1
  devices_per_node: 4
  device_memory_gb: 64
  move_gb_per_s: 5
  layout: {workers: 1, devices_per_worker: 2, training_slots: 1, devices_per_slot: 2}
models:
  m: {params_b: 1, decode_tokens_per_s: {1: 50, 16: 500}, prefill_tokens_per_s: 5000, train_tokens_per_s: 400,
      optimizer_step_s: 0.5, weights_gb: 2, state_gb: 16, weight_sync_s: 0.2}
agents:
  a: {model: m, prompt_tokens: 50, response: {median: 30, sigma: 0.5, max: 256}}
  b: {model: m, prompt_tokens: 50, response: {median: 30, sigma: 0.5, max: 256}}
graph:
  nodes: [{name: a, agent: a}, {name: b, agent: b}]
  edges: [[a, b]]
workload: {steps: 2, queries_per_step: 2, group_size: 2, micro_batch_size: 2, max_batch_size: 4}
"""


def test_simulate_a_preset_file(tmp_path) -> None:
    preset = tmp_path / "small.yaml"
    preset.write_text(SMALL)
    out = tmp_path / "out"
    args = ["simulate", "--preset", str(preset), "--out", str(out), "--modes", "sync,flexmarl"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "sim.json").read_text())
    assert set(report["modes"]) == {"sync", "flexmarl"} and report["paper"] is None
    assert report["ours"]["speedup_vs_marti"] == report["speedup_vs_sync"]["flexmarl"]
    assert (out / "timeline_sync.png").exists()


def test_bad_input_is_named(tmp_path) -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["simulate", "--preset", "paper-xx", "--out", str(tmp_path)])
    assert unknown.exit_code == 2 and "unknown simulator preset 'paper-xx'" in unknown.output
    both = runner.invoke(app, ["simulate", "--preset", "paper-ma", "--sweep", "agents", "--out", str(tmp_path)])
    assert both.exit_code == 2 and "one of --preset, --sweep or --calibrate" in both.output
    mode = runner.invoke(app, ["simulate", "--preset", "paper-ma", "--modes", "fast", "--out", str(tmp_path)])
    assert mode.exit_code == 2 and "unknown modes ['fast']" in mode.output
