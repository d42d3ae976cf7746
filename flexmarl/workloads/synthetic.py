"""Synthetic tasks that a model trained from scratch can learn in minutes: the framework's CartPole.

``copy_digits``: the question is a random digit string, the answer is that string. A random byte-level model
already writes a digit now and then, so GRPO has signal from the first step, and a policy can only reach a
high reward by reading its input: a constant answer is right for one question in ten.
"""

from __future__ import annotations

import random

from flexmarl.workloads.datasets import TaskItem


def copy_digits(size: int, seed: int, *, digits: int = 1) -> list[TaskItem]:
    """``size`` tasks whose question and answer are the same random string of ``digits`` digits."""
    if digits < 1:
        raise ValueError(f"copy_digits: digits must be at least 1, got {digits}")
    rng = random.Random(seed)
    tasks = []
    for i in range(size):
        text = "".join(rng.choice("0123456789") for _ in range(digits))
        tasks.append(TaskItem(f"copy_digits-{i:06d}", {"question": text}, text))
    return tasks


GENERATORS = {"copy_digits": copy_digits}
"""Built-in generators by ``data.dataset`` name; every other name is looked up in reasoning-gym."""
