"""A run's stop request, shared by the flow and its pipeline task through the run's Dask scheduler.

The flow asks its pipeline to stop (Ctrl-C, SIGTERM, a failure elsewhere) before anything resumes the run;
the task that runs the pipeline may be in another thread or process (under any Prefect task runner), so the
request is a Dask ``Event`` named for the run, which the pipeline loop reads at most every ``STOP_POLL_S``.
The pipeline task's own view of the run (``tasks/run_view.py``) may ask the loop to stop too, in-process.
"""

from __future__ import annotations

import threading
import time

from distributed import Client, Event

STOP_POLL_S = 0.5  # how stale the pipeline loop's view of a stop request may be


class StopSignal:
    """A run's stop request (a Dask ``Event``): ``set`` from anywhere, ``is_set`` polled by the pipeline loop.

    ``also``: an in-process request (a ``threading.Event``) that stops the loop as well, read on every turn.
    """

    def __init__(self, client: Client, run_id: str, *, also: threading.Event | None = None) -> None:
        self._event = Event(f"flexmarl/{run_id}/stop", client=client)
        self._also = also
        self._seen, self._checked = False, float("-inf")

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        if self._also is not None and self._also.is_set():
            return True
        # one scheduler round trip per STOP_POLL_S at most: the loop asks on every turn
        if not self._seen and time.monotonic() - self._checked >= STOP_POLL_S:
            self._seen, self._checked = self._event.is_set(), time.monotonic()
        return self._seen

    def clear(self) -> None:
        self._event.clear()
