"""Settings of the Dask cluster that runs rollout and training."""

from __future__ import annotations

from pydantic import Field

from flexmarl.configbase import Strict


class ClusterConfig(Strict):
    address: str | None = None
    """Scheduler address of an existing Dask cluster (``tcp://host:8786``); null starts a LocalCluster."""
    n_workers: int = Field(2, ge=1)
    """Worker processes of the LocalCluster."""
    threads_per_worker: int = Field(1, ge=1)
    """Threads per worker; torch also gets this many threads (more than the cores makes timings erratic)."""
    memory_limit: str = "auto"
    """Per-worker memory limit of the LocalCluster (Dask syntax, e.g. '6GiB')."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for the scheduler and its workers, and for a live worker to rebuild a lost worker's
    engines on, before the run fails."""
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    """A worker whose heartbeat the scheduler has not seen for this long counts as hung (a frozen process or
    host): the run restarts it through its nanny and rebuilds its replicas and trainers elsewhere."""
    worker_resources: dict[str, float] = {}
    """Dask resources every LocalCluster worker offers (e.g. ``{GPU: 1}``); existing clusters declare their own
    (``dask worker --resources "GPU=1"``)."""
    rollout_resource: str | None = None
    """Only workers offering this Dask resource host rollout replicas (e.g. 'rollout' or 'GPU'); null: any."""
    train_resource: str | None = None
    """Only workers offering this Dask resource host trainers (e.g. 'train' or 'GPU'); null: any."""
