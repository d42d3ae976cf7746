"""Evaluation through the team's own graph: the team's answer, judges' classes, and reproducible greedy runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.config import ConfigError, load_config
from flexmarl.evaluate import held_out_problems, judge_again, plan_evaluation, run_team, team_figures, team_run
from flexmarl.rollout.backend import GenerationResult
from flexmarl.rollout.episodes import Episode, NodeOutput
from flexmarl.workloads.datasets import Problem

LOOP = load_config(preset="tiny", overrides=[
    "agents.solver.prompt='Compute: {question} {verifier}'",
    "graph.edges=[[solver, verifier], [verifier, solver]]",
    "graph.loops=[{nodes: [solver, verifier], max_turns: 2, stop_when: {node: verifier, parsed: correct}}]",
])


def episode(outputs: dict[str, str]) -> Episode:
    ep = Episode(Problem("q", {"question": "1 + 1"}, "2"), 0, 0)
    for node, parsed in outputs.items():
        agent = node.split("_")[0]
        result = GenerationResult(node, [2], [0.0], "length", 0)
        ep.outputs[node] = NodeOutput(node, agent, 0, node, [1], result, parsed, parsed, [])
    return ep


def test_the_team_answers_with_the_answer_node_s_last_turn() -> None:
    accepted = team_run(episode({"solver_t0": "2", "verifier_t0": "correct"}), LOOP)
    assert accepted.team_answer == "2" and accepted.team_correct and accepted.first_answer_correct
    retried = team_run(episode({"solver_t0": "3", "verifier_t0": "incorrect", "solver_t1": "2",
                                "verifier_t1": "correct"}), LOOP)
    assert retried.team_answer == "2" and retried.team_correct and not retried.first_answer_correct
    # each verdict is judged against the answer it read: the first turn's wrong answer, the second's right one
    judged = {n.node: n.judged_right for n in retried.nodes}
    assert judged == {"solver_t0": None, "verifier_t0": False, "solver_t1": None, "verifier_t1": True}
    figures = team_figures([accepted, retried])
    assert figures["team"]["correct"] == 2 and figures["first_answer"]["correct"] == 1
    assert figures["agents"]["solver"]["calls_per_problem"] == 1.5
    judge = figures["agents"]["verifier"]["judge"]
    assert judge["tpr"]["correct"] == 2 and judge["tnr"]["correct"] == 1 and judge["balanced"] == 1.0
    # one pair (problem, first answer) per problem: the retried problem's second verdict is not among them
    first = judge["on_first_answers"]
    assert (first["n"], first["tpr"]["correct"], first["tnr"]["correct"]) == (2, 1, 1)


def test_a_verdict_repeated_on_a_repeated_answer_counts_once_on_first_answers() -> None:
    """A judge that does not read the answer rejects a right one twice when the solver repeats it: every verdict
    counts the mistake twice, the first answers once."""
    accepted = team_run(episode({"solver_t0": "2", "verifier_t0": "correct"}), LOOP)
    repeated = team_run(episode({"solver_t0": "2", "verifier_t0": "incorrect", "solver_t1": "2",
                                 "verifier_t1": "incorrect"}), LOOP)
    judge = team_figures([accepted, repeated])["agents"]["verifier"]["judge"]
    assert (judge["tpr"]["correct"], judge["tpr"]["n"]) == (1, 3)
    assert (judge["on_first_answers"]["tpr"]["correct"], judge["on_first_answers"]["tpr"]["n"]) == (1, 2)


def test_greedy_team_runs_follow_the_graph_and_repeat(tiny_dir: Path) -> None:
    problems = held_out_problems(LOOP.data, 6)
    runs = run_team(LOOP, {"solver": tiny_dir, "verifier": tiny_dir}, problems, batch_size=4)
    assert run_team(LOOP, {"solver": tiny_dir, "verifier": tiny_dir}, problems, batch_size=4) == runs
    for run in runs:
        nodes = [n.node for n in run.nodes]
        stopped = run.nodes[1].parsed == "correct"
        assert nodes == (["solver_t0", "verifier_t0"] if stopped else ["solver_t0", "verifier_t0", "solver_t1",
                                                                        "verifier_t1"])
        assert run.team_answer == run.nodes[-2].parsed
    with pytest.raises(ValueError, match="no model directory for agent"):
        run_team(LOOP, {"solver": tiny_dir}, problems)
    # the same weights judging again give the same verdicts, each problem's first marked once
    again = judge_again(LOOP, "verifier", tiny_dir, runs, batch_size=4)
    judged = [n for run in runs for n in run.nodes if n.judged_right is not None]
    assert sorted((j.verdict, j.judged_right) for j in again) == sorted((n.parsed, n.judged_right) for n in judged)
    assert sum(j.first for j in again) == len(runs)


def test_evaluation_refuses_a_directory_without_a_run_or_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a run directory"):
        plan_evaluation(tmp_path, 4)
    (tmp_path / "config.yaml").write_text(LOOP.model_dump_json())
    with pytest.raises(ConfigError, match=r"no checkpoint of \['solver', 'verifier'\]"):
        plan_evaluation(tmp_path, 4)
