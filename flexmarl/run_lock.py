"""One run at a time in a run directory: an OS file lock held for as long as a run uses the directory.

``flexmarl train`` takes the lock before it starts a Prefect server; the training flow takes it again (a
flow started from a deployment needs it too), which in the same process only counts up. The OS frees the lock
when its holder exits, even after ``kill -9``, so a crashed run never blocks a resume. Next to the lock,
``.flexmarl-lock.json`` says who holds it (pid, host, command, start time), for the refusal message.

Example:
    >>> with run_lock("runs/tiny"):
    ...     ...  # a second process's run_lock("runs/tiny") raises RunLockError naming this one
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_FILE = ".flexmarl.lock"
HOLDER_FILE = ".flexmarl-lock.json"


class RunLockError(RuntimeError):
    """The run directory is in use by another live run; the message names the holder and the fix."""


_held: dict[Path, tuple[FileLock, int, bool]] = {}  # held run directories: lock, re-entry count, created here
_guard = threading.Lock()


def holder(run_dir: str | os.PathLike) -> dict | None:
    """Who holds (or last held) the lock of ``run_dir``: pid, host, command, started; None when unknown."""
    try:
        return json.loads((Path(run_dir) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_locked(run_dir: str | os.PathLike) -> bool:
    """Whether a live process holds the lock of ``run_dir`` (creates nothing)."""
    path = Path(run_dir).resolve()
    if path in _held:
        return True
    if not (path / LOCK_FILE).exists():
        return False
    lock = FileLock(path / LOCK_FILE, timeout=0, thread_local=False)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return True
    lock.release()
    return False


@contextmanager
def run_lock(run_dir: str | os.PathLike, *, what: str = "flexmarl train") -> Iterator[Path]:
    """Hold the lock of ``run_dir`` (created if needed) until the block ends. Re-entrant within a process.

    Raises:
        RunLockError: another process holds it; the message names that process and what to do.
    """
    path = Path(run_dir).resolve()
    with _guard:
        if path in _held:
            lock, count, created = _held[path]
            _held[path] = (lock, count + 1, created)
        else:
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
            # never waits: a second run is refused at once
            lock = FileLock(path / LOCK_FILE, timeout=0, thread_local=False)
            try:
                lock.acquire(blocking=False)
            except Timeout:
                raise RunLockError(refusal(path)) from None
            _held[path] = (lock, 1, created)
            (path / HOLDER_FILE).write_text(json.dumps({
                "pid": os.getpid(), "host": socket.gethostname(), "command": what,
                "argv": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            }))
    try:
        yield path
    finally:
        with _guard:
            lock, count, created = _held[path]
            if count > 1:
                _held[path] = (lock, count - 1, created)
            else:
                del _held[path]
                (path / HOLDER_FILE).unlink(missing_ok=True)
                lock.release()
                if created and {p.name for p in path.iterdir()} == {LOCK_FILE}:
                    # a start refused under the lock leaves no trace: the directory goes as it came. Safe to
                    # unlink: filelock re-checks the inode after flock, so one who locked the old file tries again
                    (path / LOCK_FILE).unlink()
                    path.rmdir()


def refusal(run_dir: Path) -> str:
    """The message for a run directory another process holds."""
    who = holder(run_dir)
    if who is None:
        by = "another process"
    else:
        by = f"process {who['pid']} on {who['host']} ({who['command']}, started {who['started']})"
    stop = f"stop it (kill {who['pid']}) and resume with `flexmarl train --resume {run_dir}`" if who else "stop it"
    return f"{run_dir} is in use by {by}: wait for that run to end, or {stop}; or choose another --run-dir"
