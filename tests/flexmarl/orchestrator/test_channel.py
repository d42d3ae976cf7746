"""The run's channel carries the pipeline's events in order, a stop request and each update's outcome
between processes that share only the Dask scheduler."""

from __future__ import annotations

import threading

import pytest
from distributed import Client, LocalCluster

from flexmarl.orchestrator import channel as channel_mod
from flexmarl.orchestrator.channel import (
    AgentUpdateError,
    EventSender,
    RunChannel,
    StopSignal,
    UpdateNotMade,
    decode_event,
    encode_event,
)
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

EVERY_EVENT: list[PipelineEvent] = [
    StepOpened(3, ("solver", "verifier")),
    MicroBatchCommitted("solver", 3, 16, 8, 12),
    WeightSynced("solver", 4, "tcp://127.0.0.1:1", 0.25, True),
    AgentFailed("verifier", "weight sync timed out"),
    UpdateEvent("solver", 3, 4, 16, 64, None, {"loss": float("nan"), "kl": 0.01}, 9.5, skipped=True),
    StateMove("verifier", "tcp://127.0.0.1:2", 1.5, True, 0.75),
    Recovery(("tcp://127.0.0.1:1",), "hung: no heartbeat", 100.0, 103.5),
    Move(2.0, "solver", "verifier", 1.0, 7.0),
]


def test_every_pipeline_event_crosses_as_plain_data_and_comes_back_equal() -> None:
    assert {type(e) for e in EVERY_EVENT} == set(channel_mod._EVENT_TYPES.values())  # none left untested
    for event in EVERY_EVENT:
        message = encode_event(event)
        assert type(message["fields"]) is dict  # msgpack-able: no dataclass crosses
        back = decode_event(message)
        assert type(back) is type(event)
        assert repr(back) == repr(event)  # repr: a NaN loss compares unequal to itself


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
        channel.post(failed, AgentUpdateError("weight sync of agent 'verifier' timed out"))
        with pytest.raises(AgentUpdateError, match="timed out"):
            failed.wait()
        stopped = channel.outcome_ref("solver", 2)
        channel.post(stopped, UpdateNotMade("the run ended before this update: stopped"))
        with pytest.raises(UpdateNotMade, match="stopped"):
            stopped.wait()
        channel.close()
