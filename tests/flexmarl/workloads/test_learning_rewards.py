"""The rewards that make learning show: the verifier's class-balanced and mixed-only rewards, its parser, and the
copy problem's rewards."""

from __future__ import annotations

import pytest

from flexmarl.meg.spec import MEGSpec
from flexmarl.rollout.backend import GenerationResult
from flexmarl.rollout.episodes import Episode, NodeOutput
from flexmarl.rollout.scoring import sample_rows, score, trainable_samples
from flexmarl.training.config import TrainerConfig
from flexmarl.workloads.datasets import DataConfig, Problem, ProblemStream, load_problems
from flexmarl.workloads.parsers import final_verdict, first_digit
from flexmarl.workloads.rewards import RewardInput, class_balanced, copies_parent, copies_question

SPEC = MEGSpec.model_validate({
    "agents": {
        "solver": {"model": "tiny", "prompt": "{question}", "parser": "last_number", "reward": "correct_answer"},
        "verifier": {"model": "tiny", "prompt": "{question} {solver}", "parser": "verdict",
                     "reward": "verdict_balanced"},
    },
    "graph": {"nodes": [{"name": "solver", "agent": "solver"}, {"name": "verifier", "agent": "verifier"}],
              "edges": [["solver", "verifier"]]},
})


def _episode(j: int, answer: str, verdict: str) -> Episode:
    ep = Episode(Problem("q", {"question": "1 + 1"}, "2"), j, 0)
    for node, parsed in (("solver", answer), ("verifier", verdict)):
        result = GenerationResult(str(j), [2], [0.0], "length", 0)
        ep.outputs[node] = NodeOutput(node, node, 0, f"q_{node}_{j}", [1], result, parsed, parsed, [])
    return ep


def verifier_rewards(answers: list[str], verdict: str) -> list[float]:
    episodes = [_episode(j, a, verdict) for j, a in enumerate(answers)]
    score(episodes, SPEC, {"solver": TrainerConfig(), "verifier": TrainerConfig()})
    return [ep.outputs["verifier"].reward for ep in episodes]


MIXED = MEGSpec.model_validate({**SPEC.model_dump(), "agents": {
    **SPEC.model_dump()["agents"], "verifier": {**SPEC.model_dump()["agents"]["verifier"], "reward": "verdict_mixed"}}})


def mixed_scored(answers: list[str], verdicts: list[str]) -> list[Episode]:
    episodes = [_episode(j, a, v) for j, (a, v) in enumerate(zip(answers, verdicts, strict=True))]
    score(episodes, MIXED, {"solver": TrainerConfig(), "verifier": TrainerConfig()})
    return episodes


def test_the_mixed_only_verdict_reward_trains_only_groups_that_judge_both_classes() -> None:
    # all answers wrong: "no" is right every time, yet says nothing about the answer read; no advantage
    one_class = mixed_scored(["3", "4", "5", "6"], ["incorrect", "incorrect", "correct", "incorrect"])
    assert [ep.outputs["verifier"].reward for ep in one_class] == [1.0, 1.0, 0.0, 1.0]  # the reward stays plain
    assert [ep.outputs["verifier"].advantage for ep in one_class] == [0.0] * 4
    # right and wrong answers in the group: the right verdicts gain, the wrong ones lose
    mixed = mixed_scored(["2", "3", "2", "5"], ["correct", "correct", "incorrect", "incorrect"])
    advantages = [ep.outputs["verifier"].advantage for ep in mixed]
    assert advantages[0] > 0 and advantages[3] > 0 and advantages[1] < 0 and advantages[2] < 0
    # dynamic sampling leaves the one-class group out, and keeps the mixed one
    rows = sample_rows(one_class, "verifier")
    kept, dropped = trainable_samples(rows, dynamic_sampling=True)
    assert kept.num_rows == 0 and dropped == 1
    kept, dropped = trainable_samples(sample_rows(mixed, "verifier"), dynamic_sampling=True)
    assert kept.num_rows == 4 and dropped == 0


def test_the_final_verdict_is_the_last_verdict_word_after_the_reasoning() -> None:
    assert final_verdict("23 + 48 = 71. 71 is not 61. Verdict: no") == "incorrect"
    assert final_verdict("The proposed answer is wrong... no wait, Verdict: yes") == "correct"
    assert final_verdict("65 + 22 = 87\nThe proposed answer is correct.") == "correct"
    assert final_verdict("10 + 1 = 11") is None  # numbers are no verdict
    assert final_verdict("nothing to say") is None


def test_a_verifier_that_always_says_no_earns_half_in_a_mixed_group() -> None:
    answers = ["2", "3", "4", "5"]  # one right answer of four
    no = verifier_rewards(answers, "incorrect")
    assert sum(no) / 4 == pytest.approx(0.5)  # unbalanced, saying no would earn 0.75
    assert sum(verifier_rewards(answers, "correct")) / 4 == pytest.approx(0.5)
    # the right verdict on the rare right answer weighs as much as the three on wrong ones together
    assert no == pytest.approx([0.0, 2 / 3, 2 / 3, 2 / 3])


def test_a_group_of_one_class_keeps_its_rewards_and_trains_nothing() -> None:
    assert verifier_rewards(["3", "4"], "incorrect") == [1.0, 1.0]
    # balanced is mixed-only too: "no" to a group of wrong answers, some said "yes", earns no advantage
    episodes = [_episode(j, a, v) for j, (a, v) in enumerate([("3", "incorrect"), ("4", "correct")])]
    score(episodes, SPEC, {"solver": TrainerConfig(), "verifier": TrainerConfig()})
    assert [ep.outputs["verifier"].reward for ep in episodes] == [1.0, 0.0]
    assert [ep.outputs["verifier"].advantage for ep in episodes] == [0.0, 0.0]
    assert class_balanced([1.0, 0.0], ["a", "a"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 rewards for 1 classes"):
        class_balanced([1.0, 0.0], ["a"])


def test_copy_rewards_pay_only_the_input_digit() -> None:
    problem = Problem("c", {"question": "7777"}, "7")
    x = lambda parsed, parents=(), outputs=None: RewardInput("n", parsed, problem, outputs or {}, list(parents))  # noqa: E731
    assert copies_question(x("7")) == 1.0 and copies_question(x("3")) == 0.0 and copies_question(x(None)) == 0.0
    assert copies_parent(x("3", ["w"], {"w": "3"})) == 1.0 and copies_parent(x("3", ["w"], {"w": None})) == 0.0
    with pytest.raises(ValueError, match="needs a parent"):
        copies_parent(x("3"))
    assert first_digit("ab7c3") == "7" and first_digit("none") is None


def test_ten_copy_tasks_serve_each_digit_once_per_step() -> None:
    problems = load_problems(DataConfig(dataset="copy_digits", dataset_args={"repeat": 8}, size=10))
    assert {t.answer for t in problems} == set("0123456789")
    assert all(t.fields["question"] == t.answer * 8 for t in problems)
    stream = ProblemStream(problems, seed=0)
    for step in range(3):
        assert sorted(t.answer for t in stream.batch(step, 10)) == list("0123456789")


def test_each_node_is_rewarded_and_grouped_by_its_own_role() -> None:
    # the verifier first works the sum out alone (check: rewarded as an answer), then judges (its agent's reward)
    spec = MEGSpec.model_validate({**MIXED.model_dump(), "graph": {
        "nodes": [{"name": "solver", "agent": "solver"}, {"name": "verifier", "agent": "verifier"},
                  {"name": "check", "agent": "verifier", "prompt": "{question}", "parser": "last_number",
                   "reward": "correct_answer"}],
        "edges": [["solver", "verifier"], ["check", "verifier"]]}})
    episodes = []
    for j, (answer, own, verdict) in enumerate([("2", "2", "correct"), ("3", "2", "incorrect"),
                                                ("2", "5", "incorrect"), ("4", "4", "correct")]):
        ep = _episode(j, answer, verdict)
        result = GenerationResult(f"c{j}", [2], [0.0], "length", 0)
        ep.outputs["check"] = NodeOutput("check", "verifier", 2, f"c{j}", [1], result, own, own, [])
        episodes.append(ep)
    score(episodes, spec, {"solver": TrainerConfig(), "verifier": TrainerConfig()})
    assert [ep.outputs["check"].reward for ep in episodes] == [1.0, 1.0, 0.0, 0.0]
    assert [ep.outputs["verifier"].reward for ep in episodes] == [1.0, 1.0, 0.0, 0.0]
    # the check's group is its own: its advantages centre on the check's rewards alone
    assert sum(ep.outputs["check"].advantage for ep in episodes) == pytest.approx(0.0)
    assert episodes[0].outputs["check"].advantage > 0 > episodes[2].outputs["check"].advantage


def compared(reward: str, pairs: list[tuple[str, str]]) -> list[Episode]:
    """One group of episodes of ``1 + 1`` scored for a verifier that works the sum out (``same_result``) under
    ``reward``: each pair is (the solver's answer, the verifier's own result)."""
    from flexmarl.workloads.registry import parse

    spec = MEGSpec.model_validate({**SPEC.model_dump(), "agents": {**SPEC.model_dump()["agents"], "verifier": {
        "model": "tiny", "prompt": "{question}", "parser": "same_result", "reward": reward}}})
    episodes = []
    for j, (answer, own) in enumerate(pairs):
        ep = _episode(j, answer, parse("same_result", own, answer))
        ep.outputs["verifier"].text = f"1 + 1 = {own}"
        episodes.append(ep)
    score(episodes, spec, {"solver": TrainerConfig(), "verifier": TrainerConfig()})
    return episodes


def test_a_judge_that_works_alone_is_judged_by_comparison_and_learns_its_own_result() -> None:
    from flexmarl.workloads.parsers import same_result
    from flexmarl.workloads.registry import parse

    assert same_result("47 + 38 = 85", "85") == "correct"
    assert same_result("47 + 38 = 85", "75") == "incorrect" and same_result("47 + 38 = 85", None) == "incorrect"
    assert same_result("I cannot", "85") is None
    assert parse("same_result", "= 85.0", "85") == "correct" and parse("last_number", "= 85.0", None) == "85"
    episodes = compared("result_correct", [("2", "2"), ("3", "2"), ("2", "5"), ("3", "3")])
    # rewarded for its own result, whatever the solver said: its verdict follows from it
    assert [ep.outputs["verifier"].reward for ep in episodes] == [1.0, 1.0, 0.0, 0.0]
    assert [ep.outputs["verifier"].parsed for ep in episodes] == ["correct", "incorrect", "incorrect", "correct"]


def test_a_comparing_judge_rewarded_for_its_verdict_and_result_earns_most_by_the_right_sum() -> None:
    episodes = compared("verdict_and_result", [("2", "2"), ("3", "2"), ("2", "5"), ("3", "3"), ("3", "4")])
    # a wrong sum that differs from the wrong answer it judges earns half of what the right sum earns there
    assert [ep.outputs["verifier"].reward for ep in episodes] == [1.0, 1.0, 0.0, 0.0, 0.5]


def test_a_comparing_judge_rewarded_on_its_group_is_scored_on_every_answer_the_group_judged() -> None:
    # right answer 2; the group judges two right answers and two wrong ones, all "3"
    episodes = compared("verdict_on_group", [("2", "2"), ("3", "3"), ("3", "4"), ("2", "5")])
    # the right sum is right on all four; the solver's own mistake wrong on all; another wrong sum rejects the
    # wrong answers only, whichever answer it was paired with
    assert [ep.outputs["verifier"].reward for ep in episodes] == [1.0, 0.0, 0.5, 0.5]
    advantages = [ep.outputs["verifier"].advantage for ep in episodes]
    assert advantages[0] > advantages[2] == advantages[3] > advantages[1]
