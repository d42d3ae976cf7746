"""Waits on Prefect tasks are bounded: a task that does not finish is named at its bound, and the training flow
stops, with the task's error, when its pipeline task dies before it reports anything."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from distributed import LocalCluster
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

import flows.train
from flows.waiting import wait_for


@task(cache_policy=NO_CACHE)
def wait_for_file(path: str) -> str:
    start = time.monotonic()
    while not Path(path).exists() and time.monotonic() - start < 60:
        time.sleep(0.05)
    return "released"


@flow
def impatient(path: str) -> str:
    future = wait_for_file.submit(path)
    try:
        return wait_for(future, "the file task", 1, "the patience parameter")
    finally:
        Path(path).touch()  # release the task, so nothing outlives the test


def test_a_task_that_does_not_finish_is_named_at_the_bound(prefect_api, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="the file task did not finish within 1s; raise the patience parameter"):
        impatient(str(tmp_path / "release"))


@task(name="rollout-and-train", cache_policy=NO_CACHE)
def dying_pipeline(ctx, placement) -> None:
    # fault injection: the task fails before the runtime runs, so it shows nothing of the run
    raise RuntimeError("the pipeline task died before it started")


def test_the_train_flow_stops_when_its_pipeline_task_dies(prefect_api, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(flows.train, "run_pipeline", dying_pipeline)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        with pytest.raises(RuntimeError, match="the pipeline task died before it started"):
            flows.train.train_run(preset="tiny", run_dir=str(tmp_path / "run"),
                                  dask_address=cluster.scheduler_address)
