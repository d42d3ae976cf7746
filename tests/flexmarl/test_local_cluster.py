"""The LocalCluster that ``open_cluster`` starts."""

from __future__ import annotations

from distributed import Client
from distributed.system import MEMORY_LIMIT

from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster


def test_the_auto_memory_limit_shares_the_machine_between_the_workers_not_between_the_cores() -> None:
    # Dask's own 'auto' gives a worker of one thread 1/cores of the memory: half of it on this 2-core machine,
    # 1/16 on a 16-core GPU machine, where workers then pause at a small share of an idle machine's memory
    with open_cluster(ClusterConfig(n_workers=1)) as address, Client(address) as client:
        limits = [w["memory_limit"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
    assert limits == [MEMORY_LIMIT]
