"""A small simulator preset: three agents on two nodes, costs in round numbers."""

from __future__ import annotations

import pytest

from flexmarl.sim.costmodel import SimPreset, parse_preset

SMALL = """
name: small
description: planner -> solver x3 -> judge on 2 nodes of 4 devices
cluster:
  nodes: 2
  devices_per_node: 4
  device_memory_gb: 64
  swap_gb_per_s: 10
  move_gb_per_s: 5
  layout: {workers: 2, devices_per_worker: 2, training_slots: 2, devices_per_slot: 2}
models:
  m:
    params_b: 1
    rollout_devices: 1
    decode_tokens_per_s: {1: 50, 8: 300, 32: 800}
    prefill_tokens_per_s: 5000
    train_tokens_per_s: 400
    optimizer_step_s: 0.5
    weights_gb: 2
    state_gb: 16
    weight_sync_s: 0.2
agents:
  planner: {model: m, prompt_tokens: 100, response: {median: 40, sigma: 0.5, max: 512}}
  solver: {model: m, prompt_tokens: 120, response: {median: 120, sigma: 1.0, max: 512}}
  judge: {model: m, prompt_tokens: 80, response: {median: 20, sigma: 0.3, max: 512}}
graph:
  nodes:
    - {name: plan, agent: planner}
    - {name: solve, agent: solver, copies: 3}
    - {name: judge, agent: judge}
  edges: [[plan, solve], [solve, judge]]
workload:
  steps: 4
  queries_per_step: 4
  group_size: 4
  micro_batch_size: 4
  max_batch_size: 4
  replicas_per_worker: 2
  balance_threshold: 2
  balance_cooldown_s: 0.5
  seed: 7
paper: {sync_s: 10, flexmarl_s: 5, no_lb_s: 6, no_pipeline_s: 8}
"""


@pytest.fixture
def small() -> SimPreset:
    return parse_preset(SMALL, "small")


@pytest.fixture
def small_text() -> str:
    return SMALL
