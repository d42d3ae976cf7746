"""Every wait has a bound, and the error at the bound names what was waited for.

Faults are injected with replica or task functions that do not answer; everything else is real (a Dask
LocalCluster in this process, Delta tables, the tiny model). The hanging functions wait on a file rather than
sleeping, so that the test releases them at once and nothing outlives it. The weight-sync bound has its own
test in tests/flexmarl/orchestrator/test_pipeline.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from distributed import Client, LocalCluster

from flexmarl.config import load_config
from flexmarl.orchestrator.runtime import Runtime

pytestmark = pytest.mark.cluster  # a threads LocalCluster each

SMALL = ["run.steps=1", "run.queries_per_step=2", "run.group_size=2", "training.micro_batch_size=4"]


def wait_for_file(path: Path, limit_s: float = 60.0) -> None:
    """A task that does not answer until ``path`` exists (fault injection)."""
    start = time.monotonic()
    while not path.exists() and time.monotonic() - start < limit_s:
        time.sleep(0.05)


@pytest.fixture
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c:
        yield c


def test_a_dask_future_that_hangs_is_named_at_its_bound(cluster, tmp_path: Path) -> None:
    release = tmp_path / "release"
    with Client(cluster) as client:
        hung = client.submit(wait_for_file, release, pure=False)
        runtime = SimpleNamespace(timeout_s=1.0)  # Runtime._wait needs only the bound
        with pytest.raises(TimeoutError) as info:
            Runtime._wait(runtime, [hung], "starting the engines")
        release.touch()
        assert hung.result(timeout=30) is None  # the task was still running: the error came at the bound
    assert str(info.value) == (
        "starting the engines did not finish within 1s (rollout.request_timeout_s); check the Dask workers' "
        "logs, or raise the timeout for large models"
    )


def test_a_generation_that_hangs_fails_the_run_naming_what_it_waited_for(
    cluster, tmp_path: Path, monkeypatch
) -> None:
    from flexmarl.bench.pipeline_bench import run_mode
    from flexmarl.rollout import replica

    release = tmp_path / "release"

    def hanging_generate(key, requests):  # fault injection: a replica that never answers
        wait_for_file(release)
        raise RuntimeError("released")

    monkeypatch.setattr(replica, "generate", hanging_generate)  # threads: the workers run this very function
    cfg = load_config(preset="tiny", overrides=[*SMALL, "rollout.request_timeout_s=3"])
    try:
        # a threads-only cluster has no nanny to replace the hung replica: the run fails at the batch's bound
        with pytest.raises(TimeoutError, match=r"generation batch of agent 'solver' on replica \S+ did not finish "
                                               r"within 3s \(rollout.request_timeout_s\); worker \S+ has no nanny"):
            run_mode(cfg, tmp_path / "run", cluster.scheduler_address)
    finally:
        release.touch()
