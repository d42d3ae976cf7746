"""What the store and its maintenance share: their errors, commit retries, and the tables they work on.

``store.py`` and ``maintenance.py`` both import this module and not each other's internals, so that the store
can import its maintenance (an append compacts automatically) without an import circle.
"""

from __future__ import annotations

from typing import Protocol

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential


class Tables(Protocol):
    """A store's tables, by name (``ExperienceStore`` is one)."""

    def tables(self) -> list[str]: ...

    def open(self, table: str, *, version: int | None = None) -> DeltaTable: ...

    def table_uri(self, table: str) -> str: ...


class StoreError(RuntimeError):
    """A store operation failed; the message names the table and what to do."""


def commit_retries(attempts: int, *, multiplier: float, max_wait: float) -> Retrying:
    """Retry a Delta commit that lost a conflict, with jittered exponential backoff, on top of deltalake's own."""
    return Retrying(
        retry=retry_if_exception_type(CommitFailedError),
        wait=wait_random_exponential(multiplier=multiplier, max=max_wait),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )


def error_summary(exc: BaseException) -> str:
    """An error's first line: deltalake appends a native backtrace to its messages."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
