"""The allow-list of parsers and rewards a config may name.

Code listed here is trusted: it runs in the driver with the run's permissions (model-written code is run
only through ``flexmarl.workloads.sandbox``). To add one, write a plain function in ``parsers.py`` or
``rewards.py`` and list it here; docs/meg.md shows how.
"""

from __future__ import annotations

from collections.abc import Callable

from flexmarl.workloads import parsers, rewards

PARSERS: dict[str, Callable[[str], str | None]] = {
    "last_number": parsers.last_number,
    "verdict": parsers.verdict,
    "final_verdict": parsers.final_verdict,
    "text": parsers.text,
    "first_digit": parsers.first_digit,
    "python_code": parsers.python_code,
}

# Parsers that judge the first parent's parsed answer by comparing it with the node's own response.
COMPARING_PARSERS: dict[str, Callable[[str, str | None], str | None]] = {
    "same_result": parsers.same_result,
}


def parse(parser: str, text: str, first_parent: str | None) -> str | None:
    """A node's response through its parser; a comparing parser also reads the first parent's parsed answer."""
    if parser in COMPARING_PARSERS:
        return COMPARING_PARSERS[parser](text, first_parent)
    return PARSERS[parser](text)


REWARDS: dict[str, Callable[[rewards.RewardInput], float]] = {
    "correct_answer": rewards.correct_answer,
    "verdict_matches": rewards.verdict_matches,
    "verdict_balanced": rewards.verdict_matches,  # class-balanced within mixed groups: BALANCED_BY_CLASS, MIXED_ONLY
    "verdict_mixed": rewards.verdict_matches,  # trained only on groups judging both classes: MIXED_ONLY
    "verdict_checked": rewards.verdict_checked,  # MIXED_ONLY too
    "verdict_and_result": rewards.verdict_and_result,  # MIXED_ONLY too
    "verdict_on_group": rewards.verdict_matches,  # re-scored on the whole group: JUDGED_ON_GROUP, MIXED_ONLY
    "result_correct": rewards.result_correct,  # a judge's own result, its verdict a comparison (same_result)
    "copies_question": rewards.copies_question,
    "copies_parent": rewards.copies_parent,
    "final_correct": rewards.final_correct,
    "passes_tests": rewards.passes_tests,
    "asserts_agree": rewards.asserts_agree,
    "code_verdict_matches": rewards.code_verdict_matches,
}

# Judging rewards: the class a judge's sample is judged in (whether the answer it judges is right), by reward.
JUDGED_CLASS: dict[str, Callable[[rewards.RewardInput], bool]] = {
    "verdict_matches": rewards.parent_correct,
    "verdict_balanced": rewards.parent_correct,
    "verdict_mixed": rewards.parent_correct,
    "verdict_checked": rewards.parent_correct,
    "verdict_and_result": rewards.parent_correct,
    "verdict_on_group": rewards.parent_correct,
    "result_correct": rewards.parent_correct,
    "code_verdict_matches": rewards.parent_code_passes,
}
# Judging rewards reweighted within each GRPO group so that every class present weighs the same
# (``rewards.class_balanced``): a constant verdict then earns the group's mean, whichever class is more common.
BALANCED_BY_CLASS = frozenset({"verdict_balanced"})
# Judging rewards trained only in the GRPO groups whose samples judge both classes: the samples of a group that
# judges one class get no advantage, so a verifier cannot earn by reading the problem's difficulty (all of a
# group's answers wrong: "no" pays) instead of the answer it judges.
MIXED_ONLY = frozenset({"verdict_balanced", "verdict_mixed", "verdict_checked", "verdict_and_result",
                        "verdict_on_group"})
# Rewards of a comparing judge (its parser in COMPARING_PARSERS) scored on every answer of its GRPO group: its
# result, compared with each answer, is a verdict on each, and its reward is their balanced accuracy
# (``rewards.balanced_accuracy``). The answer it happened to be paired with then adds no noise to its reward.
JUDGED_ON_GROUP = frozenset({"verdict_on_group"})

# Task fields a reward reads beyond ``question`` and the answer; a config whose data lacks them is refused.
REWARD_PROBLEM_FIELDS: dict[str, set[str]] = {
    "passes_tests": {"entry_point"},
    "asserts_agree": {"entry_point"},
    "code_verdict_matches": {"entry_point"},
}
