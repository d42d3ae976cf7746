"""The learning bench's pieces: the agreement metric, the data plan, and reproducible greedy scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.bench.learning_bench import (
    GSM8K_DIR, gsm8k_train_subset, plan_learning, team_nodes, verifier_agreement,
)
from flexmarl.config import load_config
from flexmarl.evaluate import answer_node, held_out_tasks
from flexmarl.workloads.datasets import load_tasks

needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K files not present")


def test_verifier_agreement_counts_matching_verdicts_and_unreadable_ones_as_disagreeing() -> None:
    verdicts = ["correct", "incorrect", "incorrect", "correct", None, None]
    truths = [True, False, True, False, True, False]
    # agree: a right answer called correct, a wrong one called incorrect; the rest disagree
    assert verifier_agreement(verdicts, truths) == pytest.approx(2 / 6)
    # a verifier that always says "incorrect" scores the share of wrong answers
    assert verifier_agreement(["incorrect"] * 4, [False, False, False, True]) == 0.75
    with pytest.raises(ValueError, match="3 verdicts for 2 answers"):
        verifier_agreement(["correct"] * 3, [True, False])


@needs_gsm8k
def test_plan_trains_on_easy_gsm8k_train_problems_and_scores_on_gsm8k_test(tmp_path: Path) -> None:
    plan = plan_learning(tmp_path, preset="tiny", steps=3, n_eval=5, max_solution_steps=1)
    cfg = plan.config
    assert (plan.solver, plan.verifier) == ("solver", "verifier")
    assert cfg.train.steps == 3 and cfg.train.group_size == 8 and cfg.training.lr == 1e-5
    assert cfg.agents["solver"].sampling.temperature == 0.7
    # training reads the subset the plan wrote: only problems with at most one calculation
    assert cfg.data.path == tmp_path.resolve() / "train_tasks.jsonl"
    subset = [json.loads(line) for line in cfg.data.path.read_text().splitlines()]
    assert subset and all(r["answer"].count("<<") <= 1 for r in subset)
    assert subset == gsm8k_train_subset(GSM8K_DIR / "train.jsonl", 1)
    assert len(load_tasks(cfg.data)) == len(subset)
    # scoring reads the first n_eval test problems, none of which training serves
    test_rows = [json.loads(line) for line in (GSM8K_DIR / "test.jsonl").read_text().splitlines()[:5]]
    assert [t.fields["question"] for t in plan.eval_tasks] == [r["question"] for r in test_rows]
    assert not {t.fields["question"] for t in plan.eval_tasks} & {r["question"] for r in subset}


def test_plan_without_gsm8k_scores_the_preset_dataset_under_another_seed(tmp_path: Path) -> None:
    plan = plan_learning(tmp_path, preset="tiny", n_eval=4, data_dir=tmp_path / "missing",
                         overrides=["train.steps=2"])
    assert plan.config.data.path is None and plan.config.train.steps == 2
    assert plan.eval_tasks == held_out_tasks(plan.config.data, 4)
    assert plan.eval_tasks != load_tasks(plan.config.data)[:4]
    assert not (tmp_path / "train_tasks.jsonl").exists()


def test_held_out_tasks_refuse_the_run_s_own_training_file(tmp_path: Path) -> None:
    data = load_config(preset="tiny", overrides=[f"data.path={GSM8K_DIR / 'train.jsonl'}"]).data
    with pytest.raises(ValueError, match="not held out"):
        held_out_tasks(data, 4)


def test_the_bench_refuses_a_graph_that_is_not_a_solver_verifier_chain() -> None:
    with pytest.raises(ValueError, match="two-node solver -> verifier"):
        team_nodes(load_config(preset="fan_out"))


def test_greedy_scoring_of_the_same_weights_is_deterministic(tiny_dir: Path) -> None:
    cfg = load_config(preset="tiny")
    tasks = held_out_tasks(cfg.data, 6)
    first = answer_node(cfg, "solver", tiny_dir, tasks, batch_size=4)
    assert answer_node(cfg, "solver", tiny_dir, tasks, batch_size=4) == first
    assert [a.input_id for a in first] == [t.input_id for t in tasks]
    parents = [{"solver": a} for a in first]
    verdicts = answer_node(cfg, "verifier", tiny_dir, tasks, parents=parents, batch_size=4)
    assert answer_node(cfg, "verifier", tiny_dir, tasks, parents=parents, batch_size=4) == verdicts
    # the agreement is the verifier's own reward, averaged
    truths = [a.reward == 1.0 for a in first]
    assert verifier_agreement([v.parsed for v in verdicts], truths) == pytest.approx(
        sum(v.reward for v in verdicts) / len(verdicts))
    with pytest.raises(ValueError, match="pass their answers as parents"):
        answer_node(cfg, "verifier", tiny_dir, tasks)
