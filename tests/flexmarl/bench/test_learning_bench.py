"""The learning bench's pieces: the agreement metric, the data plan, and reproducible greedy scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.bench.learning_bench import (
    GSM8K_DIR, majority_vote, plan_learning, single_config, without_fields,
)
from flexmarl.config import load_config
from flexmarl.evaluate import (
    NodeRun, TeamRun, answer_node, disjoint_problems, expression_key, held_out_problems, judge_figures,
    served_problems, wilson_interval,
)
from flexmarl.workloads.datasets import Problem, load_problems

needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K files not present")


def test_judge_figures_count_each_class_and_put_the_trivial_judges_beside() -> None:
    truths = [True, False, False, False]
    always_no = judge_figures(["incorrect"] * 4, truths)
    assert always_no["tpr"]["accuracy"] == 0.0 and always_no["tnr"]["accuracy"] == 1.0
    assert always_no["balanced"] == 0.5 and always_no["always_no"] == 0.75 and always_no["always_yes"] == 0.25
    perfect = judge_figures(["correct", "incorrect", "incorrect", "incorrect"], truths)
    assert perfect["balanced"] == 1.0 and perfect["unparsed"] == 0.0
    # an unreadable verdict is wrong in either class, and counted
    unread = judge_figures([None, None, "incorrect", "correct"], truths)
    assert unread["tpr"]["correct"] == 0 and unread["tnr"]["correct"] == 1 and unread["unparsed"] == 0.5
    assert judge_figures(["correct"], [True])["balanced"] is None  # one class: no balanced accuracy
    with pytest.raises(ValueError, match="3 verdicts for 2 answers"):
        judge_figures(["correct"] * 3, [True, False])


def test_wilson_interval_matches_the_textbook_values() -> None:
    lo, hi = wilson_interval(10, 50)  # p = 0.2: (0.1124, 0.3304)
    assert lo == pytest.approx(0.11243, abs=1e-4) and hi == pytest.approx(0.33043, abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0


def test_held_out_problems_share_no_expression_with_the_training_stream(tmp_path: Path) -> None:
    plan = plan_learning(tmp_path, preset="default", steps=3, n_eval=40, gsm8k_n=0)
    served = served_problems(plan.config)
    assert len(served) == 3 * plan.config.run.queries_per_step
    keys = {expression_key(t.fields["question"]) for t in plan.eval_problems}
    assert len(keys) == 40 and not keys & {expression_key(t.fields["question"]) for t in served}
    # same numbers in other words are the same problem
    assert expression_key("What is 4 + 2 - 2?") == expression_key("Calculate 4 + 2 - 2 =") == "4+2-2"
    asked = Problem("a", {"question": "What is 1 + 2?"}, "3")
    twins = [Problem("b", {"question": "Compute 1 + 2"}, "3"), Problem("c", {"question": "2 + 1 ="}, "3")]
    assert disjoint_problems(twins, [asked], 1) == twins[1:]
    with pytest.raises(ValueError, match="only 1 held-out"):
        disjoint_problems(twins, [asked], 2)


@needs_gsm8k
def test_plan_scores_gsm8k_test_beside_the_held_out_problems(tmp_path: Path) -> None:
    plan = plan_learning(tmp_path, preset="tiny", steps=2, n_eval=5, gsm8k_n=3)
    test_rows = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").read_text().splitlines()[:3]]
    assert [t.fields["question"] for t in plan.gsm8k_problems] == [r["question"] for r in test_rows]
    assert plan.config.run.steps == 2 and plan.config.data.path is None
    assert not plan_learning(tmp_path, preset="tiny", n_eval=5, gsm8k_n=0).gsm8k_problems


def test_plan_without_gsm8k_scores_the_preset_dataset_under_another_seed(tmp_path: Path) -> None:
    plan = plan_learning(tmp_path, preset="tiny", n_eval=4, data_dir=tmp_path / "missing",
                         overrides=["run.steps=2"])
    assert plan.config.run.steps == 2 and not plan.gsm8k_problems
    question = lambda problems: [t.fields["question"] for t in problems]  # noqa: E731
    assert question(plan.eval_problems) != question(load_problems(plan.config.data)[:4])
    assert set(question(plan.eval_problems)) <= set(question(held_out_problems(plan.config.data, 16)))


def test_held_out_problems_refuse_the_run_s_own_training_file(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    data = load_config(preset="tiny", overrides=[f"data.path={train}"]).data
    with pytest.raises(ValueError, match="not held out"):
        held_out_problems(data, 4)


def test_the_single_solver_is_the_team_s_answer_agent_alone_with_its_first_turn_prompt() -> None:
    team = load_config(preset="default")
    single = single_config(team, queries_per_step=17)
    assert list(single.agents) == ["solver"] and [n.name for n in single.graph.nodes] == ["solver"]
    assert single.agents["solver"].prompt == "Compute: {question} Give the final answer as a number.\n"
    assert single.run.queries_per_step == 17 and single.run.steps == team.run.steps
    assert single.data == team.data and single.agents["solver"].sampling == team.agents["solver"].sampling
    assert without_fields("{a} {{x}} {b!r:>3}", {"b"}) == " {{x}} {b!r:>3}"


def test_majority_vote_takes_the_most_common_answer_and_the_earliest_on_a_tie() -> None:
    problem = Problem("p", {"question": "1 + 1"}, "2")

    def run(answer: str | None) -> TeamRun:
        return TeamRun(problem, (NodeRun("solver", "solver", str(answer), answer, 0.0),), answer, answer == "2",
                       answer == "2")

    assert majority_vote([[run("3")], [run("2")], [run("2")]]) == [True]
    assert majority_vote([[run("3")], [run("2")]]) == [False]  # a tie: the first sample's answer
    assert majority_vote([[run(None)], [run(None)]]) == [False]


def test_greedy_scoring_of_the_same_weights_is_deterministic(tiny_dir: Path) -> None:
    cfg = load_config(preset="tiny")
    problems = held_out_problems(cfg.data, 6)
    first = answer_node(cfg, "solver", tiny_dir, problems, batch_size=4)
    assert answer_node(cfg, "solver", tiny_dir, problems, batch_size=4) == first
    assert [a.input_id for a in first] == [t.input_id for t in problems]
    parents = [{"solver": a} for a in first]
    verdicts = answer_node(cfg, "verifier", tiny_dir, problems, parents=parents, batch_size=4)
    assert answer_node(cfg, "verifier", tiny_dir, problems, parents=parents, batch_size=4) == verdicts
    with pytest.raises(ValueError, match="pass their answers as parents"):
        answer_node(cfg, "verifier", tiny_dir, problems)


def test_accuracy_by_terms_splits_the_held_out_problems_by_their_length() -> None:
    from flexmarl.bench.learning_bench import accuracy_by_terms
    from flexmarl.workloads.datasets import Problem

    q = "State the final answer to the following arithmetic problem: {} ="
    problems = [Problem(str(i), {"question": q.format(e)}, "0") for i, e in enumerate(["1 + 2", "3 - 4", "5 + 6 - 7"])]
    assert accuracy_by_terms(problems, [True, False, False], [True, True, False]) == {
        "2": {"n": 2, "base": 0.5, "trained": 1.0}, "3": {"n": 1, "base": 0.0, "trained": 0.0}}
