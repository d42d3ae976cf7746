"""The pipeline's happenings as Prefect events, and ``flexmarl.run.failed``.

Each record the pipeline tells (``flexmarl.orchestrator.records``) becomes an event named ``flexmarl.<what>``
about the resource ``flexmarl.run.<run id>.agent.<agent>`` (the run's, when no agent is named), with the
record as its payload: automations can act on them. A recovery is told twice, as two records: without
``recovered_at`` (``flexmarl.recovery.started``), then with it (``finished``). ``flexmarl.run.failed``
names the run directory of a failed run, which the ``resume-failed-runs`` automation
(``deployments/automations.py``) resumes.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from prefect.events import emit_event

from flexmarl.orchestrator.records import (
    AgentFailed,
    MicroBatchCommitted,
    PipelineEvent,
    Recovery,
    StateMove,
    StepOpened,
    UpdateEvent,
    WeightSynced,
)
from flexmarl.rollout.balancer import Move

EVENT_NAMES: dict[type, str] = {
    StepOpened: "flexmarl.step.opened",
    MicroBatchCommitted: "flexmarl.microbatch.committed",
    UpdateEvent: "flexmarl.agent.updated",
    WeightSynced: "flexmarl.weights.synced",
    StateMove: "flexmarl.state.moved",
    Move: "flexmarl.replica.moved",
    AgentFailed: "flexmarl.agent.failed",
}
RUN_FAILED = "flexmarl.run.failed"


def event_name(event: PipelineEvent) -> str:
    if isinstance(event, Recovery):
        return "flexmarl.recovery." + ("finished" if event.recovered_at is not None else "started")
    return EVENT_NAMES[type(event)]


def emit_pipeline_event(run_id: str, event: PipelineEvent) -> None:
    """``event`` as a Prefect event about its agent (or the run); queued, never waits on the API."""
    agent = getattr(event, "target", None) or getattr(event, "agent", None)
    resource_id = f"flexmarl.run.{run_id}" + (f".agent.{agent}" if agent else "")
    emit_event(event=event_name(event), resource={"prefect.resource.id": resource_id, "flexmarl.run": run_id,
                                                   "prefect.resource.name": agent or run_id},
               payload=_jsonable(asdict(event)))


def emit_run_failed(run_id: str, run_dir: str, error: BaseException) -> None:
    """``flexmarl.run.failed``, with the run directory to resume (the ``resume-failed-runs`` automation's cue)."""
    emit_event(event=RUN_FAILED, resource={"prefect.resource.id": f"flexmarl.run.{run_id}",
                                           "flexmarl.run": run_id, "prefect.resource.name": run_id},
               payload={"run_dir": str(Path(run_dir).resolve()), "error": f"{type(error).__name__}: {error}"})


def _jsonable(value):
    """``value`` with tuples as lists and non-finite floats (a skipped update's NaN loss) as None."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
