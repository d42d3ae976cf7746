"""The supervisor's view of the cluster: the workers the scheduler knows, never a cache that forgets them."""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster
from distributed.client import SchedulerInfo

from flexmarl.cluster.local import scheduler_workers, workers_offering


@pytest.mark.cluster
def test_live_workers_come_from_the_scheduler_not_the_clients_cache(monkeypatch) -> None:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        workers = sorted(cluster.scheduler.workers)

        async def periodic_refresh(n_workers: int = 0) -> None:
            # Dask's own refresh every 2 s asks for no workers; when it lands last, the cache lists none
            client._scheduler_identity = SchedulerInfo({"workers": {}})

        monkeypatch.setattr(client, "_update_scheduler_info", periodic_refresh)
        assert client.scheduler_info(n_workers=-1)["workers"] == {}  # what made both live workers look lost
        assert sorted(scheduler_workers(client)) == workers
        assert workers_offering(client, None, "rollout") == workers
