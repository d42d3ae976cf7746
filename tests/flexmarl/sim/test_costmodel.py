"""Simulator presets: the shipped ones load; bad ones are refused with the field and the fix named."""

from __future__ import annotations

import numpy as np
import pytest

from flexmarl.sim.costmodel import PRESETS, PresetError, load_preset, parse_preset


@pytest.mark.parametrize("name", PRESETS)
def test_shipped_presets_load_and_fit_the_paper_cluster(name: str) -> None:
    preset = load_preset(name)
    assert preset.cluster.total_devices == 768
    assert preset.cluster.layout.devices <= 768 and preset.cluster.sync_layout.devices <= 768
    assert {n.agent for n in preset.graph.nodes} == set(preset.agents)


def test_paper_presets_carry_the_papers_numbers() -> None:
    ratios = load_preset("paper-ma").paper.ratios()
    assert ratios["speedup_vs_marti"] == pytest.approx(174.1 / 126.1)
    assert load_preset("paper-ca").paper.no_pipeline_s == 124.1


@pytest.mark.parametrize(("edit", "message"), [
    (("model: m, prompt_tokens: 100", "model: big, prompt_tokens: 100"), "unknown model 'big'"),
    (("{name: judge, agent: judge}", "{name: judge, agent: juge}"), "did you mean 'judge'"),
    (("edges: [[plan, solve], [solve, judge]]", "edges: [[plan, solve], [solve, judge], [judge, plan]]"), "cycle"),
    (("layout: {workers: 2,", "layout: {workers: 9,"), "shrink the layout"),
    (("state_gb: 16", "state_gb: 900"), "does not fit a training slot"),
    (("rollout_devices: 1", "rollout_devices: 4"), "give workers more devices"),
    (("max_batch_size: 4", "max_batch_size: 0"), "max_batch_size"),
])
def test_invalid_presets_name_the_problem(small_text: str, edit: tuple[str, str], message: str) -> None:
    assert edit[0] in small_text
    with pytest.raises(PresetError, match=message):
        parse_preset(small_text.replace(*edit), "small")


def test_unknown_preset_name_suggests_the_closest() -> None:
    with pytest.raises(PresetError, match="did you mean 'paper-ma'"):
        load_preset("paper-mx")


def test_decode_step_grows_with_the_batch_and_interpolates(small) -> None:
    model = small.models["m"]
    steps = model.step_seconds(np.array([1.0, 8.0, 4.0, 64.0]))
    assert steps[0] == pytest.approx(1 / 50) and steps[1] == pytest.approx(8 / 300)
    assert steps[0] < steps[2] < steps[1]  # between the points
    assert steps[3] == pytest.approx(64 / 800)  # flat rate beyond the last point


def test_response_lengths_follow_the_distribution_and_the_cap(small) -> None:
    dist = small.agents["solver"].response
    draws = dist.sample(np.random.default_rng(0), 20000)
    assert draws.max() <= 512 and abs(np.median(draws) - 120) < 5
    empirical = dist.model_copy(update={"empirical": [3, 5]})
    assert set(empirical.sample(np.random.default_rng(0), 100)) == {3, 5}
