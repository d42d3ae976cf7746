"""`bench adapters` on the tiny model: every case in its own process, and adapter agents move a fraction of the
bytes of full-model agents (memory is reported, not asserted: on the tiny model the interpreter dominates it)."""

from __future__ import annotations

import pytest

from flexmarl.bench.adapter_bench import bench_adapters
from flexmarl.models.adapter_config import AdapterConfig


@pytest.mark.cluster  # worker processes that each build and train every agent
def test_adapter_agents_sync_and_swap_a_fraction_of_the_bytes_of_full_model_agents(model_cache) -> None:
    report = bench_adapters("tiny", [2], AdapterConfig(r=4, alpha=8), log=lambda _: None)
    assert {(r["kind"], r["agents"]) for r in report["runs"]} == {("full", 2), ("lora", 2)}
    assert all(r["peak_rss_bytes"] > 50e6 for r in report["runs"])  # a whole process: torch and the models
    ratios = report["lora_over_full"]["2_agents"]
    assert 0 < ratios["sync_bytes_per_update"] < 0.1 and 0 < ratios["swap_bytes"] < 0.1
