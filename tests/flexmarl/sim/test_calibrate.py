"""Calibration measures the real components on this machine: the tiny model's costs, lengths and prompts."""

from __future__ import annotations

from flexmarl.sim.calibrate import measure_lengths, measure_model, prompt_tokens_of


def test_measured_costs_of_the_tiny_model_are_consistent() -> None:
    m = measure_model("tiny", batches=(1, 2), new_tokens=4, prompt_tokens=8, repeats=1)
    assert set(m["decode_tokens_per_s"]) == {1, 2} and min(m["decode_tokens_per_s"].values()) > 0
    assert m["train_tokens_per_s"] > 0 and m["optimizer_step_s"] > 0 and m["weight_sync_s"] > 0
    # float32 weights plus two Adam moments: about three times the weights
    assert 2.5 < m["state_gb"] / m["weights_gb"] < 3.5
    assert m["move_gb_per_s"] > 0


def test_lengths_respect_the_generation_limit_and_prompts_leave_parents_out() -> None:
    lengths = measure_lengths("tiny", 6, n=8, prompt_tokens=8)
    assert len(lengths) == 8 and all(1 <= n <= 6 for n in lengths)
    prompts = prompt_tokens_of("fan_out")
    assert set(prompts) == {"planner", "solver", "aggregator"}
    assert all(n > 10 for n in prompts.values())

