"""One line for a run that failed for a reason outside it: the disk filled up, or the Prefect API went away.

Neither is a bug to show a traceback for, and neither loses what the run committed (a commit that could not
be written is not in the store; training state is written before its update is recorded), so the line names
the cause and the way on: ``flexmarl train --resume``.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

from flows.prefect_server import PrefectAPIError, check_api

NO_SPACE = ("No space left on device", "os error 28")


def explain_failure(exc: BaseException, api_url: str, run_dir: Path) -> str | None:
    """The line for ``exc`` when the disk is full or the API at ``api_url`` no longer answers, else None."""
    full = next((e for e in _chain(exc) if _no_space(e)), None)
    if full is not None:
        return (f"the run stopped: the disk is full ({type(full).__name__}: {_first_line(full)}); what it committed "
                f"is kept: free space under {run_dir.resolve()}, then {_resume(run_dir)}")
    try:
        check_api(api_url, timeout_s=5.0)
    except PrefectAPIError:
        return lost_api_line(api_url, run_dir, f"{type(exc).__name__}: {_first_line(exc)}")
    return None


def lost_api_line(api_url: str, run_dir: Path, cause: str) -> str:
    """The line for a run whose Prefect API went away, for ``cause``."""
    return (f"the run stopped: the Prefect API at {api_url} stopped answering ({cause}); what it committed is "
            f"kept: {_resume(run_dir)} (it starts a new server unless PREFECT_API_URL names one)")


def _resume(run_dir: Path) -> str:
    return f"continue it with `flexmarl train --resume {run_dir}`"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _no_space(exc: BaseException) -> bool:
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or any(s in str(exc) for s in NO_SPACE)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
