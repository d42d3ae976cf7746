"""What crosses between a run's control-plane tasks while it runs, through its Dask scheduler.

The task that runs the pipeline, the flow that shows it and the task runs that wait for each agent update
share no memory: each reaches the others through objects of the Dask scheduler named for the run, so any of
them may run in another thread or process (under any Prefect task runner) that can reach the scheduler.

- the pipeline's events (``records.PipelineEvent``), in order, on a Dask ``Queue``. The pipeline loop only
  hands them to a thread (``EventSender``), which ships them in batches: the loop never waits on the scheduler;
- a stop request, a Dask ``Event``, that the pipeline loop reads at most every ``STOP_POLL_S``;
- each agent update's outcome (its ``UpdateEvent``, or the error that ended it), a Dask ``Variable`` named for
  the agent and version, which its waiting task reads from wherever it runs (``OutcomeRef``).

Values cross as msgpack-able dicts (``encode_event``/``decode_event``): the scheduler's msgpack carries plain
data, and nothing here unpickles (``tests/test_security.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import get_args

from distributed import Client, Event, Queue, Variable
from pydantic import TypeAdapter

from flexmarl.orchestrator.records import PipelineEvent, UpdateEvent

log = logging.getLogger(__name__)

STOP_POLL_S = 0.5  # how stale the pipeline loop's view of a stop request may be
_END = None  # ends the event stream


def _name(run_id: str, what: str) -> str:
    return f"flexmarl/{run_id}/{what}"


class AgentUpdateError(RuntimeError):
    """An agent's update failed: the error of the agent's task that failed the run."""


class UpdateNotMade(Exception):
    """The run ended before this update was made (stopped, or failed on another agent)."""


_EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in get_args(PipelineEvent)}
_OUTCOME_ERRORS: dict[str, type[Exception]] = {"failed": AgentUpdateError, "not_made": UpdateNotMade}


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def encode_event(event: PipelineEvent) -> dict:
    """``event`` as plain data the scheduler's msgpack carries (tuples become lists; ``decode_event`` restores)."""
    return {"type": type(event).__name__, "fields": dataclasses.asdict(event)}


def decode_event(message: dict) -> PipelineEvent:
    return _adapter(_EVENT_TYPES[message["type"]]).validate_python(message["fields"])


def _encode_outcome(value: UpdateEvent | BaseException) -> dict:
    if isinstance(value, UpdateEvent):
        return {"update": encode_event(value)}
    if isinstance(value, UpdateNotMade):
        return {"error": "not_made", "message": str(value)}
    message = str(value) if isinstance(value, AgentUpdateError) else f"{type(value).__name__}: {value}"
    return {"error": "failed", "message": message}


def _decode_outcome(message: dict) -> UpdateEvent:
    if "update" in message:
        return decode_event(message["update"])
    raise _OUTCOME_ERRORS[message["error"]](message["message"])


class StopSignal:
    """A run's stop request (a Dask ``Event``): ``set`` from anywhere, ``is_set`` polled by the pipeline loop."""

    def __init__(self, client: Client, run_id: str) -> None:
        self._event = Event(_name(run_id, "stop"), client=client)
        self._seen, self._checked = False, float("-inf")

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        # one scheduler round trip per STOP_POLL_S at most: the loop asks on every turn
        if not self._seen and time.monotonic() - self._checked >= STOP_POLL_S:
            self._seen, self._checked = self._event.is_set(), time.monotonic()
        return self._seen

    def clear(self) -> None:
        self._event.clear()


class EventSender:
    """The pipeline's side of the event stream: ``put`` is cheap; a thread ships what is put, in order.

    Use it as a context manager: leaving it ships everything put so far before it returns.
    """

    def __init__(self, client: Client, run_id: str) -> None:
        self._queue = Queue(_name(run_id, "events"), client=client)
        self._pending: queue.Queue[PipelineEvent | None] = queue.Queue()
        self._thread = threading.Thread(target=self._ship, name=f"events-{run_id}", daemon=True)

    def __enter__(self) -> EventSender:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._pending.put(_END)
        self._thread.join()
        self._queue.close()

    def put(self, event: PipelineEvent) -> None:
        self._pending.put(event)

    def _ship(self) -> None:
        while True:
            batch = [self._pending.get()]
            while not self._pending.empty() and batch[-1] is not _END:
                batch.append(self._pending.get_nowait())
            done = batch[-1] is _END
            events = batch[:-1] if done else batch
            if events:
                try:
                    self._queue.put([encode_event(e) for e in events])
                except Exception as exc:  # noqa: BLE001 - the scheduler is gone: the run fails on its own
                    log.warning("could not send %d pipeline event(s) to the flow: %s", len(events), exc)
            if done:
                return


@dataclass(frozen=True)
class OutcomeRef:
    """Where one agent update's outcome is posted: small and picklable, so that its task may wait anywhere."""

    address: str  # the Dask scheduler
    name: str
    connect_timeout_s: float

    def wait(self) -> UpdateEvent:
        """Block until the outcome is posted: the update, or the error posted in its place, raised here as
        ``AgentUpdateError`` (the agent failed) or ``UpdateNotMade``."""
        with Client(self.address, timeout=f"{self.connect_timeout_s}s", set_as_default=False) as client:
            variable = Variable(self.name, client=client)
            message = variable.get()
            variable.delete()
        return _decode_outcome(message)


class RunChannel:
    """The flow's side: it reads the events, requests the stop and posts each update's outcome."""

    def __init__(self, client: Client, address: str, run_id: str, connect_timeout_s: float) -> None:
        self.client, self.address, self.run_id = client, address, run_id
        self.connect_timeout_s = connect_timeout_s
        self._queue = Queue(_name(run_id, "events"), client=client)
        self.stop = StopSignal(client, run_id)

    def events(self) -> Iterator[PipelineEvent]:
        """The pipeline's events, in order, until ``end_events`` is called (after the pipeline task ends)."""
        while (batch := self._queue.get()) is not _END:
            yield from map(decode_event, batch)

    def end_events(self) -> None:
        self._queue.put(_END)

    def outcome_ref(self, agent: str, version: int) -> OutcomeRef:
        return OutcomeRef(self.address, _name(self.run_id, f"update/{agent}/v{version}"), self.connect_timeout_s)

    def post(self, ref: OutcomeRef, value: UpdateEvent | BaseException) -> None:
        Variable(ref.name, client=self.client).set(_encode_outcome(value))

    def close(self) -> None:
        self._queue.close()
        self.stop.clear()
