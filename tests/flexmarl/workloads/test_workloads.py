from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from flexmarl.workloads.datasets import DataConfig, DataError, Problem, ProblemStream, load_problems
from flexmarl.workloads.parsers import last_number, verdict
from flexmarl.workloads.rewards import RewardInput, correct_answer, verdict_matches

GSM8K = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so 12 + 7 = 19.", "19"), ("It costs $1,234.00", "1234"), ("-3 then 0.50", "0.5"), ("no digits", None)],
)
def test_last_number(text: str, expected: str | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Yes, it is right", "correct"), ("no.", "incorrect"), ("0", "incorrect"), ("1", "correct"), ("hmm", None)],
)
def test_verdict(text: str, expected: str | None) -> None:
    assert verdict(text) == expected


def test_rewards() -> None:
    problem = Problem("q", {"question": "1+1"}, "2")
    right = RewardInput("solver", "2", problem, {"solver": "2"}, [])
    assert correct_answer(right) == 1.0
    assert correct_answer(RewardInput("solver", None, problem, {"solver": None}, [])) == 0.0
    # the verifier is right when it rejects a wrong answer and accepts a right one
    assert verdict_matches(RewardInput("verifier", "incorrect", problem, {"solver": "3"}, ["solver"])) == 1.0
    assert verdict_matches(RewardInput("verifier", "correct", problem, {"solver": "3"}, ["solver"])) == 0.0
    assert verdict_matches(RewardInput("verifier", "correct", problem, {"solver": "2"}, ["solver"])) == 1.0
    assert verdict_matches(RewardInput("verifier", None, problem, {"solver": "2"}, ["solver"])) == 0.0


@pytest.mark.skipif(not GSM8K.exists(), reason="shared GSM8K data not present")
def test_reads_real_gsm8k() -> None:
    problems = load_problems(DataConfig(path=GSM8K, size=5))
    assert len(problems) == 5
    assert problems[0].answer == "18"  # "#### 18" in the first test problem
    assert "ducks" in problems[0].fields["question"]


def test_corrupt_jsonl_line_is_named(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b"\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: not a JSON object"):
        load_problems(DataConfig(path=path))


def test_missing_data_file(tmp_path) -> None:
    with pytest.raises(ValidationError, match="data file .*nope.jsonl does not exist"):
        DataConfig(path=tmp_path / "nope.jsonl")  # refused when the config is validated
    path = tmp_path / "gone.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n')
    cfg = DataConfig(path=path)
    path.unlink()  # and if it disappears after validation, the read names it
    with pytest.raises(DataError, match="gone.jsonl does not exist"):
        load_problems(cfg)


def test_problem_stream_is_deterministic_and_unique_across_epochs() -> None:
    problems = [Problem(f"t{i}", {"question": str(i)}, str(i)) for i in range(5)]
    stream = ProblemStream(problems, seed=3)
    ids = [t.input_id for step in range(4) for t in stream.batch(step, 3)]
    assert ids == [t.input_id for step in range(4) for t in ProblemStream(problems, seed=3).batch(step, 3)]
    assert len(ids) == len(set(ids)) == 12  # the second epoch gets a suffix
    assert sorted(ids[:5]) == [f"t{i}" for i in range(5)]


def test_reasoning_gym_tasks() -> None:
    problems = load_problems(DataConfig(dataset="basic_arithmetic", size=3, dataset_args={"max_terms": 2}))
    assert len(problems) == 3 and all(t.answer.lstrip("-").isdigit() for t in problems)


def test_reasoning_gym_list_and_bool_arguments() -> None:
    """A list argument (``operators``) reaches reasoning-gym as its tuple, and a bool stays a bool."""
    cfg = DataConfig(dataset="basic_arithmetic", size=20, dataset_args={
        "min_terms": 2, "max_terms": 2, "operators": ["+"], "allow_parentheses": False, "allow_negation": False})
    assert cfg.dataset_args["allow_negation"] is False
    questions = [t.fields["question"] for t in load_problems(cfg)]
    assert all("+" in q and "-" not in q and "*" not in q and "/" not in q and "(" not in q for q in questions)
