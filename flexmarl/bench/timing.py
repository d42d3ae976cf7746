"""Timing what runs on an accelerator too: the benches' two ways to time a call."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, with the GPU's queued work finished before and after (on CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], seconds: float) -> float:
    """The shortest of repeated ``timed`` calls of ``fn`` within ``seconds``, after one warm-up call."""
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        best = min(best, timed(fn))
        if time.perf_counter() >= deadline:
            return best
