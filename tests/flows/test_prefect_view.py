"""What Prefect shows of a run: a real task run per agent update, with its true span and state, and events.

The pipeline task's view (``tasks/run_view.py``) shows what its pipeline tells; ``UpdateLedger`` decides
when each update starts and how it ends, from the pipeline's records alone.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import get_args

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.events.worker import EventsWorker

from flexmarl.config import load_config
from flexmarl.orchestrator.records import (
    AgentFailed,
    PipelineEvent,
    Recovery,
    StepOpened,
    UpdateEvent,
    WeightSynced,
)
from flexmarl.orchestrator.runtime import RunContext
from tasks.events import EVENT_NAMES, event_name
from tasks.run_view import RunView
from tasks.updates import AgentUpdateError, Settled, UpdateKey, UpdateLedger, UpdateNotMade


def task_runs(flow_run_id, expected: int | None = None, timeout_s: float = 60) -> dict:
    """The run's update task runs, once ``expected`` of them are in a final state: the API records task run
    states from the client's events, asynchronously, so a read right after the run can see them behind."""
    EventsWorker.drain_all(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="update-")))
        settled = [r for r in runs if r.state is not None and r.state.is_final() and r.end_time is not None]
        if len(settled) >= (expected or 1) or time.monotonic() > deadline:
            return {r.name: r for r in runs}
        time.sleep(1)


def events_of(run_id: str, name: str, timeout_s: float = 30) -> list[dict]:
    """The first page of events ``name`` about the run that the API holds (they arrive asynchronously)."""
    EventsWorker.drain_all(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            page = client.request("POST", "/events/filter", json={"filter": {
                "event": {"name": [name]}, "resource": {"labels": {"flexmarl.run": [run_id]}},
            }, "limit": 50}).json()
        if page["events"] or time.monotonic() > deadline:
            return page["events"]
        time.sleep(1)


def view_of(tmp_path: Path) -> RunView:
    """The view a pipeline task of the tiny preset opens (tracking off), for a run of two agents at v0."""
    ctx = RunContext("run-test", str(tmp_path), str(tmp_path / "store"), "tcp://127.0.0.1:1")
    return RunView(ctx, load_config(preset="tiny"), {"solver": 0, "verifier": 0})


def test_every_agent_update_is_a_task_run_from_its_admission_to_its_sync(tiny_run) -> None:
    steps = 2  # the tiny_run fixture's
    agents = sorted(tiny_run.report["agents"])
    runs = task_runs(tiny_run.flow_run_id, expected=steps * len(agents))
    assert sorted(runs) == sorted(f"update-{a}-v{v}" for a in agents for v in range(1, steps + 1))
    for name, run in runs.items():
        agent = name.split("-")[1]
        assert run.state.is_completed() and f"agent:{agent}" in run.tags, (name, run.state, run.tags)
        assert run.end_time > run.start_time >= run.expected_start_time
    # The pipeline runs the agents' updates at once: each task run is created when its step is admitted
    # (expected_start_time) and ends once its update is synced, so the agents' spans overlap. (Prefect marks a
    # run Running when a thread picks it up: on a loaded machine a new thread can take seconds to.)
    solver, verifier = runs["update-solver-v1"], runs["update-verifier-v1"]
    assert solver.expected_start_time < verifier.end_time and verifier.expected_start_time < solver.end_time

    run_id = tiny_run.report["run_id"]
    for name in ("flexmarl.step.opened", "flexmarl.microbatch.committed", "flexmarl.weights.synced"):
        assert events_of(run_id, name), f"no {name} event for the run"
    updated = events_of(run_id, "flexmarl.agent.updated")
    assert sorted((e["payload"]["agent"], e["payload"]["policy_version"]) for e in updated) == sorted(
        (a, v) for a in agents for v in range(1, steps + 1))
    assert {e["resource"]["prefect.resource.id"] for e in updated} == {f"flexmarl.run.{run_id}.agent.{a}"
                                                                        for a in agents}
    assert all("staleness" in e["payload"] for e in updated)


def test_the_ledger_makes_an_update_once_its_weights_reach_every_replica() -> None:
    ledger = UpdateLedger()
    assert ledger.on(StepOpened(0, ("solver", "verifier"))).started == (UpdateKey("solver", 1),
                                                                          UpdateKey("verifier", 1))
    update = UpdateEvent("solver", 0, 1, 8, 32, 0.5, {}, 1.0)
    assert ledger.on(update).recorded == update
    assert ledger.on(WeightSynced("solver", 1, "w0", 0.1, 4096, all_synced=False)).settled == ()  # one replica to go
    assert ledger.on(WeightSynced("solver", 1, "w1", 0.1, 4096, all_synced=True)).settled == (
        Settled(UpdateKey("solver", 1), update),)
    (failed,) = ledger.on(AgentFailed("verifier", "WeightSyncError: timed out")).settled
    assert failed.key == UpdateKey("verifier", 1) and isinstance(failed.outcome, AgentUpdateError)
    assert ledger.close(None) == () and not ledger.waiting


def test_the_ledger_settles_what_is_left_when_the_pipeline_ends() -> None:
    ledger = UpdateLedger()
    ledger.on(StepOpened(0, ("solver",)))
    ledger.on(StepOpened(1, ("solver",)))
    update = UpdateEvent("solver", 0, 1, 8, 32, 0.5, {}, 1.0)
    ledger.on(update)  # recorded, its last sync never told: the run has it all the same
    made, not_made = ledger.close("stopped")
    assert made == Settled(UpdateKey("solver", 1), update)
    assert not_made.key == UpdateKey("solver", 2) and isinstance(not_made.outcome, UpdateNotMade)
    assert "the run ended before this update: stopped" in str(not_made.outcome)


def test_every_pipeline_record_has_an_event_name_and_a_recovery_two() -> None:
    assert set(get_args(PipelineEvent)) == {*EVENT_NAMES, Recovery}  # none left without a name
    started = Recovery(("tcp://127.0.0.1:1",), "lost", 100.0)
    assert event_name(started) == "flexmarl.recovery.started"
    assert event_name(Recovery(started.workers, started.cause, 100.0, 103.5)) == "flexmarl.recovery.finished"


def test_an_update_fails_with_its_agents_error_and_the_others_end_cancelled(prefect_api, tmp_path: Path) -> None:
    update = UpdateEvent("solver", 0, 1, 8, 32, 0.5, {"loss": 0.1}, 1.0)

    @flow
    def pipeline_told() -> None:
        with pytest.raises(RuntimeError, match="the pipeline failed"), view_of(tmp_path) as view:
            view.put(StepOpened(0, ("solver", "verifier")))
            view.put(StepOpened(1, ("solver",)))
            view.put(update)
            view.put(WeightSynced("solver", 1, "w0", 0.1, 4096, all_synced=True))
            view.put(AgentFailed("verifier", "WeightSyncError: weight sync of agent 'verifier' to v1 timed out"))
            raise RuntimeError("the pipeline failed")

    state = pipeline_told(return_state=True)
    runs = task_runs(state.state_details.flow_run_id, expected=3)
    assert runs["update-solver-v1"].state.is_completed()
    assert runs["update-verifier-v1"].state.is_failed()
    assert "timed out" in runs["update-verifier-v1"].state.message
    assert runs["update-solver-v2"].state.is_cancelled()
    assert "the pipeline failed" in runs["update-solver-v2"].state.message


def test_a_view_that_cannot_show_stops_the_pipeline_and_fails_with_its_error(prefect_api, tmp_path: Path,
                                                                            monkeypatch) -> None:
    def api_gone(*args) -> None:  # fault injection: the progress artifact cannot be written
        raise ConnectionError("the Prefect API went away")

    monkeypatch.setattr("tasks.run_view.set_progress", api_gone)
    stopped: list[bool] = []

    @flow
    def pipeline_told() -> None:
        with pytest.raises(ConnectionError, match="went away"), view_of(tmp_path) as view:
            view.put(StepOpened(0, ("solver", "verifier")))
            view.put(UpdateEvent("solver", 0, 1, 8, 32, 0.5, {}, 1.0))
            stopped.append(view.failed.wait(timeout=60))  # the loop's stop flag (StopSignal's `also`)

    state = pipeline_told(return_state=True)
    assert stopped == [True]
    runs = task_runs(state.state_details.flow_run_id, expected=2)
    assert runs["update-solver-v1"].state.is_completed()  # recorded: the run has it
    assert runs["update-verifier-v1"].state.is_cancelled() and "went away" in runs["update-verifier-v1"].state.message


def test_the_flow_run_shows_the_graph_and_the_agents_rewards_as_pictures(tiny_run) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[tiny_run.flow_run_id])))
    images = {a.key: a.data for a in artifacts if a.type == "image"}
    assert set(images) >= {"meg", "agent-rewards"}, {a.key: a.type for a in artifacts}
    for key, url in images.items():
        head, data = url.split(",", 1)
        assert head == "data:image/png;base64" and base64.b64decode(data).startswith(b"\x89PNG"), key
    assert (tiny_run.run_dir / "meg.png").exists() and (tiny_run.run_dir / "rewards.png").exists()
