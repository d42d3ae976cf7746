"""The allow-list of parsers and rewards a config may name. Code listed here is trusted: it runs in workers."""

from __future__ import annotations

from collections.abc import Callable

from flexmarl.workloads import parsers, rewards

PARSERS: dict[str, Callable[[str], str | None]] = {
    "last_number": parsers.last_number,
    "verdict": parsers.verdict,
    "text": parsers.text,
}

REWARDS: dict[str, Callable[[rewards.RewardInput], float]] = {
    "correct_answer": rewards.correct_answer,
    "verdict_matches": rewards.verdict_matches,
    "final_correct": rewards.final_correct,
}
