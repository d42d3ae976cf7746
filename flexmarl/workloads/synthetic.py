"""Synthetic problems that a model trained from scratch can learn in minutes: the framework's CartPole.

``copy_digits``: the question is a random digit string, the answer is that string. A random byte-level model
already writes a digit now and then, so GRPO has signal from the first step, and a policy can only reach a
high reward by reading its input: a constant answer is right for one question in ten.
"""

from __future__ import annotations

import random


def copy_digits(size: int, seed: int, *, digits: int = 1, repeat: int = 1) -> list[tuple[str, str]]:
    """``size`` problems whose answer is a random string of ``digits`` digits and whose question is that string
    written ``repeat`` times (``"777"`` for ``7`` at ``repeat=3``), as (question, answer) pairs. Every block of
    ten problems starts with each digit once.

    Repeating the input makes it a larger share of the prompt, so a freshly initialised model, whose attention
    is still spread evenly over the prompt, already carries it to the position that writes the answer.
    """
    if digits < 1 or repeat < 1:
        raise ValueError(f"copy_digits: digits and repeat must be at least 1, got {digits} and {repeat}")
    rng = random.Random(seed)
    problems: list[tuple[str, str]] = []
    while len(problems) < size:
        # each block of ten problems starts with each digit once: ten problems ask every digit, so none is favoured
        for first in rng.sample("0123456789", 10)[: size - len(problems)]:
            text = first + "".join(rng.choice("0123456789") for _ in range(digits - 1))
            problems.append((text * repeat, text))
    return problems


GENERATORS = {"copy_digits": copy_digits}
"""Built-in generators by ``data.dataset`` name; every other name is looked up in reasoning-gym."""
