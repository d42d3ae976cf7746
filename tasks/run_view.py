"""What the Prefect UI, the experiment trackers and the logs show of the pipeline a task runs, as it runs.

The pipeline loop is plain Dask and never waits on the Prefect API: it only hands each record it tells
(``flexmarl.orchestrator.records``) to ``RunView.put``. One thread of the pipeline task takes them in order
and, for each:

- emits it as a Prefect event (``events.py``);
- starts an ``agent-update`` task run per agent of an admitted step and settles it, through an in-process
  future, when the ``UpdateLedger`` says (``updates.py``). The task runs go to a thread pool of this
  process, whatever the flow's task runner (under a process pool, Prefect would send them to other
  processes, which the future cannot reach). A task run costs hundreds of milliseconds of bookkeeping, so
  generation batches and micro-batches are never task runs; at most agents x (``max_staleness`` + 1) wait
  at once;
- for a recorded update: logs it to the trackers the config turns on, moves the progress artifact and logs
  the progress and the time left.

If showing fails (the Prefect API is gone), the thread asks the pipeline loop to stop (``failed``) and the
task fails with that error once the loop has stopped: the run then ends as resumable, as any failure does.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType

from prefect.futures import PrefectFuture, wait
from prefect.logging import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from flexmarl.config import RunConfig
from flexmarl.orchestrator.pipeline import PipelineStopped
from flexmarl.orchestrator.records import PipelineEvent, UpdateEvent
from flexmarl.orchestrator.runtime import RunContext
from flexmarl.tracking.tracker import RunTracker
from tasks.events import emit_pipeline_event
from tasks.publish import set_progress, start_progress
from tasks.updates import Settled, UpdateKey, UpdateLedger, agent_update

FINAL_WAIT_S = 60.0  # for the waiting task runs to record their end once told, at the end of the run


@dataclass(frozen=True)
class _End:
    why: str | None  # why the pipeline ended; None: it finished


class RunView:
    """The pipeline task's view of its run; a context manager around the pipeline.

    Args:
        ctx: the run.
        cfg: its config (tracking, steps, agents).
        versions: each agent's version when the pipeline starts (a resumed run's are past 0).
    """

    def __init__(self, ctx: RunContext, cfg: RunConfig, versions: dict[str, int]) -> None:
        self.run_id = ctx.run_id
        self.failed = threading.Event()  # showing failed: the pipeline loop stops at its next turn
        self.error: Exception | None = None
        self._tracker = RunTracker(cfg.tracking, run_dir=ctx.run_dir, run_name=ctx.run_id, config=cfg)
        self._inbox: queue.SimpleQueue[PipelineEvent | _End] = queue.SimpleQueue()
        self._ledger = UpdateLedger()
        self._outcomes: dict[UpdateKey, Future] = {}
        self._runs: list[PrefectFuture] = []
        self._total = cfg.run.steps * len(cfg.agents)
        self._done_before = sum(min(v, cfg.run.steps) for v in versions.values())  # a resumed run's
        self._recorded = 0

    def __enter__(self) -> RunView:
        with ExitStack() as stack:
            self._runner = stack.enter_context(ThreadPoolTaskRunner())
            stack.enter_context(self._tracker)
            if self._tracker.enabled:
                get_run_logger().info("tracking: %s", ", ".join(self._tracker.enabled))
            self._progress = start_progress()
            # the thread runs in this task run's context: its task runs, artifacts and logs belong to it
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._serve,), name=f"view-{self.run_id}",
                                            daemon=True)
            self._started = time.perf_counter()
            self._thread.start()
            self._stack = stack.pop_all()
        return self

    def put(self, event: PipelineEvent) -> None:
        """Called by the pipeline loop: never waits."""
        self._inbox.put(event)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        ended = self.error or exc
        if ended is None:
            why = None
        elif isinstance(ended, PipelineStopped):
            why = str(ended)
        else:
            why = f"{type(ended).__name__}: {ended}"
        self._inbox.put(_End(why))
        self._thread.join()  # each Prefect call it may be in is bounded by the client's own timeouts
        wait(self._runs, timeout=FINAL_WAIT_S)
        failure = self.error or exc
        self._stack.__exit__(type(failure) if failure else None, failure, None)
        if self.error is not None:
            raise self.error

    def _serve(self) -> None:
        while not isinstance(item := self._inbox.get(), _End):
            if self.error is not None:
                continue  # failed: the loop stops soon; what it still tells is dropped
            try:
                self._show(item)
            except Exception as exc:  # noqa: BLE001 - the run fails with it, once the loop has stopped
                self.error = exc
                self.failed.set()
        self._settle(self._ledger.close(item.why))

    def _show(self, event: PipelineEvent) -> None:
        emit_pipeline_event(self.run_id, event)
        change = self._ledger.on(event)
        for key in change.started:
            outcome: Future = Future()
            self._outcomes[key] = outcome
            run = agent_update.with_options(tags=[f"agent:{key.agent}"])
            self._runs.append(self._runner.submit(run, {"agent": key.agent, "version": key.version,
                                                        "outcome": outcome}))
        self._settle(change.settled)
        if change.recorded is not None:
            self._on_update(change.recorded)

    def _settle(self, settled: tuple[Settled, ...]) -> None:
        for s in settled:
            outcome = self._outcomes.pop(s.key, None)  # None: its task run never started (showing failed)
            if outcome is None:
                continue
            if isinstance(s.outcome, UpdateEvent):
                outcome.set_result(s.outcome)
            else:
                outcome.set_exception(s.outcome)

    def _on_update(self, update: UpdateEvent) -> None:
        self._recorded += 1
        done = self._done_before + self._recorded
        self._tracker.log_update(update)
        set_progress(self._progress, done, self._total)
        left = (time.perf_counter() - self._started) / self._recorded * (self._total - done)
        get_run_logger().info("progress: %d of %d agent updates; about %.0f min left", done, self._total, left / 60)
