"""What the store and its maintenance share: their errors, commit retries, and the tables they work on.

``store.py`` and ``maintenance.py`` both import this module and not each other's internals, so that the store
can import its maintenance (an append compacts automatically) without an import circle.
"""

from __future__ import annotations

from typing import Protocol

import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError
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


def error_summary(exc: BaseException, limit: int = 200) -> str:
    """An error's first line, cut at ``limit`` characters: deltalake appends a native backtrace to its messages,
    and its kernel errors print whole Rust structs."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= limit else line[:limit] + " ..."




class TableLoadError(StoreError, DeltaError):
    """A Delta table whose log does not load. Still a ``DeltaError``, so that callers that report a damaged table
    and go on keep doing so; ``detail`` is the message without the table's name."""

    def __init__(self, table: str, detail: str) -> None:
        super().__init__(f"{table}: {detail}")
        self.table = table
        self.detail = detail


def log_versions(table_uri: str, storage_options: dict[str, str] | None = None) -> list[int] | None:
    """The versions of the commit files in the table's ``_delta_log``, sorted; None when it cannot be listed."""
    if storage_options:
        return None  # object stores: listing needs their credentials; the message then names no version
    try:
        fs, path = pafs.FileSystem.from_uri(f"{table_uri}/_delta_log")
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.extension == "json"]
    except (OSError, ValueError):
        return None
    return sorted(int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit())


def first_unloadable_version(table_uri: str, storage_options: dict[str, str] | None = None) -> int | None:
    """The first commit at which the table stops loading (a bisection over the commits in ``_delta_log``)."""
    versions = log_versions(table_uri, storage_options)
    if not versions:
        return None
    lo, hi = 0, len(versions) - 1  # loading versions[hi] fails; find the first index that fails
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            DeltaTable(table_uri, version=versions[mid])
            lo = mid + 1
        except Exception:  # noqa: BLE001 - any failure to load counts
            hi = mid
    return versions[lo]


def describe_delta_error(table_uri: str, exc: BaseException, storage_options: dict[str, str] | None = None) -> str:
    """What is wrong with a table whose Delta log fails to load, in one line: the version at fault and the fix."""
    versions = log_versions(table_uri, storage_options)
    missing = sorted(set(range(versions[0], versions[-1] + 1)) - set(versions)) if versions else []
    if missing:  # the kernel names the file before the gap, which is not the one to restore
        gone = ", ".join(f"{v:020d}.json" for v in missing[:3]) + (" ..." if len(missing) > 3 else "")
        return (f"the Delta log is missing commit {missing[0]} ({gone} in _delta_log), so versions from "
                f"{missing[0]} on do not load; restore that commit file from a backup; versions before "
                f"{missing[0]} still read")
    version = first_unloadable_version(table_uri, storage_options)
    if version is None:
        return f"the Delta log fails to load: {error_summary(exc)}; restore the table's _delta_log from a backup"
    return (f"the Delta log fails to load at version {version}: {error_summary(exc)}; restore that commit file "
            "of _delta_log from a backup; earlier versions still read")
