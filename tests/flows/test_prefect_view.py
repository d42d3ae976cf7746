"""What Prefect shows of a run: a real task run per agent update, with its true span and state, and events."""

from __future__ import annotations

import base64
import time
from contextlib import contextmanager

from distributed import Client, LocalCluster
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.events.worker import EventsWorker

from flexmarl.orchestrator.channel import RunChannel
from flexmarl.orchestrator.records import AgentFailed, StepOpened, UpdateEvent, WeightSynced
from tasks.updates import UpdateBoard


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


@contextmanager
def channel_of(run_id: str):
    """A run's channel on a scheduler of its own, as the flow opens one on the run's cluster."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        channel = RunChannel(client, cluster.scheduler_address, run_id, connect_timeout_s=30)
        try:
            yield channel
        finally:
            channel.close()


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


def test_an_update_fails_with_its_agents_error_and_the_others_end_cancelled(prefect_api) -> None:
    update = UpdateEvent("solver", 0, 1, 8, 32, 0.5, {"loss": 0.1}, 1.0)

    @flow
    def pipeline_told() -> None:
        with channel_of("run-test") as channel:
            board = UpdateBoard(channel)
            board.on(StepOpened(0, ("solver", "verifier")))
            board.on(StepOpened(1, ("solver",)))
            board.on(update)
            board.on(WeightSynced("solver", 1, "w0", 0.1, all_synced=True))
            board.on(AgentFailed("verifier", "WeightSyncError: weight sync of agent 'verifier' to v1 timed out"))
            board.close("the pipeline failed")

    state = pipeline_told(return_state=True)
    runs = task_runs(state.state_details.flow_run_id, expected=3)
    assert runs["update-solver-v1"].state.is_completed()
    assert runs["update-verifier-v1"].state.is_failed()
    assert "timed out" in runs["update-verifier-v1"].state.message
    assert runs["update-solver-v2"].state.is_cancelled()
    assert "the pipeline failed" in runs["update-solver-v2"].state.message


def test_an_update_waits_for_its_weights_to_reach_every_replica(prefect_api) -> None:
    waiting: list[bool] = []

    @flow
    def pipeline_told() -> None:
        with channel_of("run-test") as channel:
            board = UpdateBoard(channel)
            board.on(StepOpened(0, ("solver",)))
            board.on(UpdateEvent("solver", 0, 1, 8, 32, 0.5, {}, 1.0))
            board.on(WeightSynced("solver", 1, "w0", 0.1, all_synced=False))
            waiting.append(("solver", 1) in board.outcomes)  # not posted yet
            board.on(WeightSynced("solver", 1, "w1", 0.1, all_synced=True))
            waiting.append(("solver", 1) in board.outcomes)
            board.close(None)

    state = pipeline_told(return_state=True)
    assert waiting == [True, False]
    assert task_runs(state.state_details.flow_run_id, expected=1)["update-solver-v1"].state.is_completed()


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
