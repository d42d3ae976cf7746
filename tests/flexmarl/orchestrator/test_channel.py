"""A run's stop request reaches its pipeline loop from another client of the run's Dask scheduler, or from
the pipeline task's own view of the run, in-process."""

from __future__ import annotations

import threading

import pytest
from distributed import Client, LocalCluster

from flexmarl.orchestrator import channel as channel_mod
from flexmarl.orchestrator.channel import StopSignal


@pytest.fixture(scope="module")
def scheduler():
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def test_a_stop_request_reaches_the_pipeline_within_the_poll(scheduler: str, monkeypatch) -> None:
    monkeypatch.setattr(channel_mod, "STOP_POLL_S", 0.0)
    with Client(scheduler, set_as_default=False) as flow_side, Client(scheduler, set_as_default=False) as task_side:
        flow_stop, loop_stop = StopSignal(flow_side, "run-b"), StopSignal(task_side, "run-b")
        assert not loop_stop.is_set()
        flow_stop.set()
        assert loop_stop.is_set()
        assert not StopSignal(task_side, "run-c").is_set()  # another run's
        flow_stop.clear()


def test_the_views_own_request_stops_the_loop_at_once(scheduler: str) -> None:
    with Client(scheduler, set_as_default=False) as task_side:
        failed = threading.Event()
        loop_stop = StopSignal(task_side, "run-d", also=failed)
        assert not loop_stop.is_set()
        failed.set()
        assert loop_stop.is_set()  # read on every turn, not polled through the scheduler
