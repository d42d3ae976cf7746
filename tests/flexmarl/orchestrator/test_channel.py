"""The run's channel carries the pipeline's events in order, a stop request and each update's outcome
between processes that share only the Dask scheduler."""

from __future__ import annotations

import threading

import pytest
from distributed import Client, LocalCluster

from flexmarl.orchestrator import channel as channel_mod
from flexmarl.orchestrator.channel import EventSender, RunChannel, StopSignal
from flexmarl.orchestrator.records import StepOpened, UpdateEvent


@pytest.fixture(scope="module")
def scheduler():
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def test_events_arrive_in_order_and_end_once_the_stream_is_ended(scheduler: str) -> None:
    with Client(scheduler, set_as_default=False) as flow_side, Client(scheduler, set_as_default=False) as task_side:
        channel = RunChannel(flow_side, scheduler, "run-a", connect_timeout_s=10)
        with EventSender(task_side, "run-a") as sender:
            for step in range(200):
                sender.put(StepOpened(step, ("solver",)))
        channel.end_events()
        assert [e.step for e in channel.events()] == list(range(200))
        channel.close()


def test_a_stop_request_reaches_the_pipeline_within_the_poll(scheduler: str, monkeypatch) -> None:
    monkeypatch.setattr(channel_mod, "STOP_POLL_S", 0.0)
    with Client(scheduler, set_as_default=False) as flow_side, Client(scheduler, set_as_default=False) as task_side:
        flow_stop, loop_stop = StopSignal(flow_side, "run-b"), StopSignal(task_side, "run-b")
        assert not loop_stop.is_set()
        flow_stop.set()
        assert loop_stop.is_set()
        assert not StopSignal(task_side, "run-c").is_set()  # another run's
        flow_stop.clear()


def test_an_outcome_is_waited_for_wherever_it_is_posted_from(scheduler: str) -> None:
    update = UpdateEvent("solver", 0, 1, 8, 32, 0.5, {"loss": 0.1}, 1.0)
    with Client(scheduler, set_as_default=False) as flow_side:
        channel = RunChannel(flow_side, scheduler, "run-d", connect_timeout_s=10)
        made, failed = channel.outcome_ref("solver", 1), channel.outcome_ref("verifier", 1)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(made.wait()))  # waits before it is posted
        waiter.start()
        channel.post(made, update)
        waiter.join(timeout=30)
        assert got == [update]
        channel.post(failed, RuntimeError("weight sync of agent 'verifier' timed out"))
        with pytest.raises(RuntimeError, match="timed out"):
            failed.wait()
        channel.close()
