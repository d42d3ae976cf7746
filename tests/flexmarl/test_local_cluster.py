"""The LocalCluster that ``open_cluster`` starts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import dask
import pytest
from distributed import Client
from distributed.system import MEMORY_LIMIT

from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster

pytestmark = pytest.mark.cluster


def test_the_auto_memory_limit_shares_the_machine_between_the_workers_not_between_the_cores() -> None:
    # Dask's own 'auto' gives a worker of one thread 1/cores of the memory: half of it on this 2-core machine,
    # 1/16 on a 16-core GPU machine, where workers then pause at a small share of an idle machine's memory
    with open_cluster(ClusterConfig(n_workers=1)) as address, Client(address) as client:
        limits = [w["memory_limit"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
    assert limits == [MEMORY_LIMIT]


SLOW_START = '''
import os, time

def dask_setup(worker):
    if os.path.exists(os.environ["FLEXMARL_TEST_SLOW_START"]):
        time.sleep(float(os.environ["FLEXMARL_TEST_SLOW_START_S"]))
'''


def test_a_worker_whose_restart_outlasts_dask_s_lost_worker_timeout_comes_back(tmp_path: Path) -> None:
    """A killed worker whose nanny takes longer than Dask's lost-worker timeout to restart it (a busy machine)
    must come back: Dask's LocalCluster closed such a nanny mid-restart, and lost the worker for good."""
    slow, preload = tmp_path / "slow", tmp_path / "slow_start.py"
    preload.write_text(SLOW_START)
    delay_s = dask.utils.parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout")) + 5
    env = {"FLEXMARL_TEST_SLOW_START": str(slow), "FLEXMARL_TEST_SLOW_START_S": str(delay_s)}
    with dask.config.set({"distributed.worker.preload": [str(preload)]}), \
            open_cluster(ClusterConfig(n_workers=2), env=env) as address, Client(address) as client:
        before = client.run(os.getpid)
        slow.touch()  # from now on a worker takes delay_s to start
        os.kill(next(iter(before.values())), signal.SIGKILL)
        deadline = time.monotonic() + delay_s + 90
        pids: dict = {}
        while time.monotonic() < deadline:
            pids = client.run(os.getpid, on_error="ignore")
            if sum(isinstance(p, int) and p not in before.values() for p in pids.values()) == 1 and len(pids) == 2:
                break
            time.sleep(0.5)
        assert len(pids) == 2 and set(pids.values()) != set(before.values()), pids
