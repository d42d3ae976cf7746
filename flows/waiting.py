"""Bounded waits on Prefect task futures: a task that does not finish in time is named, never waited on forever."""

from __future__ import annotations

from typing import TypeVar

from prefect.futures import PrefectFuture

R = TypeVar("R")


def wait_for(future: PrefectFuture[R], what: str, timeout_s: float, setting: str) -> R:
    """The task's result, with its own error re-raised; a ``TimeoutError`` naming it after ``timeout_s``.

    Args:
        future: the submitted task run.
        what: what the task does, for the message (``"the rollout-and-train task"``).
        timeout_s: the bound.
        setting: the setting or parameter that holds the bound, so that the message names the fix.
    """
    future.wait(timeout_s)
    if not future.state.is_final():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s; raise {setting} if it needs longer")
    return future.result()
