"""Reward functions: plain functions of one node's output in its episode, returning a float.

A reward may raise: the episode is then recorded as failed and the run goes on (see the rollout engine).
Rewards run on the driver, in its scoring threads (``orchestrator/collector.py``), so they must be
thread-safe; the code rewards run model-written code only through ``sandbox.run_python``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from flexmarl.workloads.datasets import Problem
from flexmarl.workloads.parsers import canonical_number, last_number
from flexmarl.workloads.sandbox import SandboxLimits, run_python


@dataclass(frozen=True)
class RewardInput:
    node: str
    parsed: str | None  # this node's parsed output; None when it did not parse
    problem: Problem
    parsed_outputs: dict[str, str | None]  # every finished node of the episode -> its parsed output
    parents: list[str]  # this node's parents that ran (expanded names, e.g. solver_0 .. solver_3)
    final: tuple[str, ...] = ()  # the episode's final nodes: they ran and no node that ran reads them
    text: str = ""  # this node's response, as its parser read it


def _is_correct(parsed: str | None, answer: str) -> bool:
    return parsed is not None and parsed == canonical_number(answer)


def correct_answer(x: RewardInput) -> float:
    """1.0 when the node's final number equals the problem's answer."""
    return float(_is_correct(x.parsed, x.problem.answer))


def result_correct(x: RewardInput) -> float:
    """1.0 when the last number of the node's response is the problem's answer: the reward of a judge whose
    verdict is a comparison (``same_result``), which learns its own result."""
    return float(_is_correct(last_number(x.text), x.problem.answer))


def parent_correct(x: RewardInput) -> bool:
    """Whether the first parent's answer is right: the class a verdict on it is judged against."""
    return bool(x.parents) and _is_correct(x.parsed_outputs.get(x.parents[0]), x.problem.answer)


def verdict_matches(x: RewardInput) -> float:
    """1.0 when the verdict on the first parent's answer matches whether that answer is right."""
    if x.parsed is None or not x.parents:
        return 0.0
    return float((x.parsed == "correct") == parent_correct(x))


WORKED = re.compile(r"=\s*(-?\d[\d,]*(?:\.\d+)?)")


def worked_result(text: str) -> str | None:
    """The number right after the first ``=`` of a verifier's working (``"99 + 71 = 170. Verdict: no"`` ->
    ``"170"``), None without one."""
    match = WORKED.search(text)
    return canonical_number(match.group(1)) if match else None


def _verdict_with_result(x: RewardInput, result: str | None) -> float:
    """0 for a wrong (or unreadable) verdict on the first parent's answer; for a right one, 1 when the judge's
    own result is the problem's answer, else 0.5."""
    if x.parsed is None or not x.parents or (x.parsed == "correct") != parent_correct(x):
        return 0.0
    return 1.0 if _is_correct(result, x.problem.answer) else 0.5


def verdict_checked(x: RewardInput) -> float:
    """For a verifier that works the problem out before its verdict: its verdict's reward, with half credit when
    its working does not reach the problem's answer (the result after its first ``=``).

    The verdict decides whether anything is earned, so always agreeing or always refusing never pays more than
    judging; the half credit makes the verifier's own sum worth getting right, which a 135M verifier rewarded
    for its verdict alone drops (it learns to answer a bare "yes" or "no", docs/performance.md).
    """
    return _verdict_with_result(x, worked_result(x.text))


def verdict_and_result(x: RewardInput) -> float:
    """For a judge whose verdict is a comparison (``same_result``): its verdict's reward, with half credit when its
    own result (its last number) is not the problem's answer. Rewarded for the verdict alone, any wrong result
    but the wrong answer it judges earns as much as the right one, and the judge's sums drift
    (docs/performance.md, "Learning"); here the right sum always earns most."""
    return _verdict_with_result(x, last_number(x.text))


def class_balanced(rewards: list[float], classes: list[object]) -> list[float]:
    """Reweight a group's rewards so that every class present carries the same total weight.

    A sample of a class with ``k`` members in a group of ``n`` with ``c`` classes present is weighted
    ``n / (c * k)``: the group's mean becomes the mean over classes of each class's mean reward (the
    balanced accuracy, for agreement rewards), and a group of one class keeps its rewards. A verifier then
    earns no more by always saying "incorrect" to a mostly wrong solver than by always saying "correct".

    Example:
        >>> class_balanced([1.0, 1.0, 1.0, 0.0], [False, False, False, True])  # always "incorrect"
        [0.6666666666666666, 0.6666666666666666, 0.6666666666666666, 0.0]
    """
    if len(rewards) != len(classes):
        raise ValueError(f"{len(rewards)} rewards for {len(classes)} classes")
    counts: dict[object, int] = {}
    for c in classes:
        counts[c] = counts.get(c, 0) + 1
    n, present = len(rewards), len(counts)
    return [r * n / (present * counts[c]) for r, c in zip(rewards, classes, strict=True)]


def balanced_accuracy(verdicts: list[str | None], classes: list[bool]) -> float:
    """The mean over the classes present of the share of right verdicts: ``"correct"`` on a right answer
    (class True), ``"incorrect"`` on a wrong one; an unreadable verdict (None) is never right.

    The reward ``verdict_on_group`` of a judge whose verdict is its own result compared with the answer
    (``same_result``): such a judge does not read the answer, so its result gives a verdict on every answer of
    its group, and is scored on all of them (``rollout/scoring.py``).

    Example: the right sum 2 judges [2, 3, 3] right on all; the wrong 3 accepts the wrong 3s and rejects the 2.
        >>> balanced_accuracy(["correct", "incorrect", "incorrect"], [True, False, False])
        1.0
        >>> balanced_accuracy(["incorrect", "correct", "correct"], [True, False, False])
        0.0
    """
    if len(verdicts) != len(classes):
        raise ValueError(f"{len(verdicts)} verdicts for {len(classes)} classes")
    by_class: dict[bool, list[bool]] = {}
    for v, c in zip(verdicts, classes, strict=True):
        by_class.setdefault(c, []).append(v is not None and (v == "correct") == c)
    return sum(sum(right) / len(right) for right in by_class.values()) / len(by_class) if by_class else 0.0


def final_correct(x: RewardInput) -> float:
    """The share of the episode's final nodes (e.g. the aggregator) whose answer is correct.

    Rewards a node upstream (a planner) for the team's result rather than for its own text.
    """
    if not x.final:
        return 0.0
    return sum(_is_correct(x.parsed_outputs.get(n), x.problem.answer) for n in x.final) / len(x.final)


# --- copy_digits (workloads/synthetic.py) ---
# No partial credit for writing some digit: measured on the tiny model, such credit is learned first and
# independently of the input, and the policy then stalls at a constant digit (mean reward ~0.28).


def copies_question(x: RewardInput) -> float:
    """1.0 when the node's first digit is the first digit of the problem's answer."""
    return float(x.parsed is not None and x.parsed == x.problem.answer[:1])


def copies_parent(x: RewardInput) -> float:
    """1.0 when the node's first digit is its first parent's first digit (0 when the parent wrote none)."""
    if not x.parents:
        raise ValueError(f"node {x.node!r}: copies_parent needs a parent node to copy")
    target = x.parsed_outputs.get(x.parents[0])
    return float(target is not None and x.parsed == target)


# --- code (HumanEval): the problem's fields hold the stub (question) and entry_point, its answer the tests ---

CODE_LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_mb=512)


def solution_program(problem: Problem, code: str) -> str:
    """The stub (imports, signature, docstring) followed by the code: a whole function or the body."""
    entry = re.escape(problem.fields["entry_point"])
    if re.search(rf"^\s*def\s+{entry}\s*\(", code, re.MULTILINE):
        return f"{problem.fields['question']}\n\n{code}\n"  # the new definition replaces the stub
    return f"{problem.fields['question']}{code}\n"  # an indented body continuing the stub


def hidden_tests_pass(problem: Problem, code: str | None) -> bool:
    """Whether ``code`` passes the problem's hidden tests (run in the sandbox)."""
    if code is None:
        return False
    check = f"check({problem.fields['entry_point']})"
    return _runs_clean(f"{solution_program(problem, code)}\n{problem.answer}\n\n{check}\n")


@lru_cache(maxsize=4096)  # the coder's and the tester's rewards run the same programs
def _runs_clean(program: str) -> bool:
    return run_python(program, limits=CODE_LIMITS).ok


def passes_tests(x: RewardInput) -> float:
    """1.0 when the node's code passes the problem's hidden tests."""
    return float(hidden_tests_pass(x.problem, x.parsed))


def _parent_code(x: RewardInput) -> str | None:
    if not x.parents:
        raise ValueError(f"node {x.node!r}: a code-judging reward needs the coder as a parent node")
    return x.parsed_outputs.get(x.parents[0])


def asserts_agree(x: RewardInput) -> float:
    """For a tester that writes asserts on the first parent's code.

    0.0 when the asserts are missing (no ``assert`` calling the entry point) or fail on the reference
    solution; 0.5 when they are valid but judge the parent's code differently from the hidden tests;
    1.0 when they are valid and agree with the hidden tests.
    """
    entry = x.problem.fields["entry_point"]
    tests = x.parsed
    if tests is None or "assert" not in tests or entry not in tests:
        return 0.0
    reference = f"{solution_program(x.problem, x.problem.meta['canonical_solution'])}\n{tests}\n"
    if not _runs_clean(reference):
        return 0.0
    code = _parent_code(x)
    tester_accepts = code is not None and _runs_clean(f"{solution_program(x.problem, code)}\n{tests}\n")
    return 1.0 if tester_accepts == hidden_tests_pass(x.problem, code) else 0.5


def parent_code_passes(x: RewardInput) -> bool:
    """Whether the first parent's code passes the hidden tests: the class a verdict on it is judged against."""
    return hidden_tests_pass(x.problem, _parent_code(x))


def code_verdict_matches(x: RewardInput) -> float:
    """For a tester that answers with a verdict: 1.0 when it says ``correct`` exactly when the first
    parent's code passes the hidden tests."""
    if x.parsed is None:
        return 0.0
    return float((x.parsed == "correct") == parent_code_passes(x))
