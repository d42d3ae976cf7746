"""Reward functions: plain functions of one node's output in its episode, returning a float.

A reward may raise: the episode is then recorded as failed and the run goes on (see the rollout engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmarl.workloads.datasets import TaskItem
from flexmarl.workloads.parsers import canonical_number


@dataclass(frozen=True)
class RewardInput:
    node: str
    parsed: str | None  # this node's parsed output; None when it did not parse
    task: TaskItem
    parsed_outputs: dict[str, str | None]  # every finished node of the episode -> its parsed output
    parents: list[str]  # this node's parents that ran (expanded names, e.g. solver_0 .. solver_3)
    final: tuple[str, ...] = ()  # the episode's final nodes: they ran and no node that ran reads them


def _is_correct(parsed: str | None, answer: str) -> bool:
    return parsed is not None and parsed == canonical_number(answer)


def correct_answer(x: RewardInput) -> float:
    """1.0 when the node's final number equals the task's answer."""
    return float(_is_correct(x.parsed, x.task.answer))


def verdict_matches(x: RewardInput) -> float:
    """1.0 when the verdict on the first parent's answer matches whether that answer is right."""
    if x.parsed is None or not x.parents:
        return 0.0
    truth = _is_correct(x.parsed_outputs.get(x.parents[0]), x.task.answer)
    return float((x.parsed == "correct") == truth)


def final_correct(x: RewardInput) -> float:
    """The share of the episode's final nodes (e.g. the aggregator) whose answer is correct.

    Rewards a node upstream (a planner) for the team's result rather than for its own text.
    """
    if not x.final:
        return 0.0
    return sum(_is_correct(x.parsed_outputs.get(n), x.task.answer) for n in x.final) / len(x.final)
