"""The run-time estimate printed before a run starts."""

from __future__ import annotations

import pytest

from flexmarl.config import load_config
from flexmarl.estimate import describe_estimate, estimate_run_s, prompt_tokens
from flexmarl.workloads.datasets import load_problems


def test_the_estimate_grows_with_steps_samples_and_tokens() -> None:
    base = load_config(preset="tiny", overrides=["run.steps=10"])
    seconds = estimate_run_s(base)
    assert seconds is not None and seconds > 0
    assert estimate_run_s(load_config(preset="tiny", overrides=["run.steps=20"])) == pytest.approx(2 * seconds)
    assert estimate_run_s(load_config(preset="tiny", overrides=["run.steps=10", "run.group_size=8"])) > seconds
    assert estimate_run_s(load_config(preset="tiny", overrides=["run.steps=10", "cluster.n_workers=4"])) < seconds
    # the verifier's prompt holds the solver's answer: longer than the solver's own
    problem = load_problems(base.data)[0]
    assert prompt_tokens(base, "verifier", problem) > prompt_tokens(base, "solver", problem)
    assert describe_estimate(base).startswith("10 steps per agent: about ")


def test_a_model_without_measured_costs_gets_no_estimate(tmp_path, tiny_dir) -> None:
    cfg = load_config(preset="tiny", overrides=[f"agents.solver.model={tiny_dir}"])
    assert estimate_run_s(cfg) is None
    assert "no time estimate" in describe_estimate(cfg)


@pytest.mark.cluster  # the default preset's SmolLM2 tokenizer: the model is built from its GGUF file first (~20 s)
def test_states_written_every_k_updates_cost_a_kth_of_the_writes() -> None:
    est = {k: estimate_run_s(load_config(preset="default", overrides=[f"run.snapshot_every={k}"])) for k in (1, 4)}
    none = estimate_run_s(load_config(preset="default", overrides=["run.save_state=false"]))
    assert none < est[4] < est[1]
    assert est[1] - none == pytest.approx(4 * (est[4] - none))


def test_turns_an_early_stop_may_skip_count_at_their_expected_share() -> None:
    from flexmarl.estimate import LATER_TURN_SHARE, expected_runs

    loop = ["graph.edges=[[solver, verifier], [verifier, solver]]", "training.micro_batch_size=12",
            "agents.solver.prompt='{question} {verifier}'"]
    stopping = load_config(preset="tiny", overrides=[
        *loop, "graph.loops=[{nodes: [solver, verifier], max_turns: 3, stop_when: {node: verifier, parsed: correct}}]"])
    always = load_config(preset="tiny", overrides=[*loop, "graph.loops=[{nodes: [solver, verifier], max_turns: 3}]"])
    assert expected_runs(stopping, "solver") == pytest.approx(1 + 2 * LATER_TURN_SHARE)
    assert expected_runs(always, "solver") == 3
    assert estimate_run_s(stopping) < estimate_run_s(always)
