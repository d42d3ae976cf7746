"""The reward gate: commits and step ends wait for their groups' rewards and keep the scheduler's order."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from flexmarl.orchestrator.collector import RewardGate
from flexmarl.orchestrator.commands import Commit, MicroBatch, StepDone


def commit(step: int, *queries: int) -> Commit:
    return Commit("solver", step, (MicroBatch("solver", step, min(queries), set(queries)),), False)


def carry_out(gate: RewardGate, commands: list) -> list:
    """What an executor carries out this turn: the released commands first, then the new ones not held."""
    done = []
    for cmd in [*gate.released(), *commands]:
        if not gate.held_back(cmd):
            done.append(cmd)
    return done


def test_a_commit_waits_for_its_groups_and_the_step_end_for_every_group_in_order() -> None:
    gate, q0, q1 = RewardGate(), Future(), Future()
    gate.scoring(0, 0, q0)
    gate.scoring(0, 1, q1)
    first, second, end = commit(0, 0), commit(0, 1), StepDone(0)
    assert carry_out(gate, [first, second, end]) == [] and gate.pending
    q0.set_result(None)
    assert carry_out(gate, []) == [first]  # the step's end still waits for query 1, and stays behind it
    assert gate.held == [second, end]
    q1.set_result(None)
    assert carry_out(gate, []) == [second, end] and not gate.pending


def test_a_command_that_needs_nothing_scored_still_waits_behind_a_held_one() -> None:
    gate, q0 = RewardGate(), Future()
    gate.scoring(3, 0, q0)
    held, free = commit(3, 0), commit(3, 1)
    assert carry_out(gate, [held, free]) == []
    q0.set_result(None)
    assert carry_out(gate, []) == [held, free]


def test_a_scoring_that_fails_fails_the_run_when_its_commit_is_asked_about() -> None:
    gate, q0 = RewardGate(), Future()
    gate.scoring(0, 0, q0)
    q0.set_exception(RuntimeError("scoring broke"))
    with pytest.raises(RuntimeError, match="scoring broke"):
        gate.held_back(commit(0, 0))
