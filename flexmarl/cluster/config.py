"""Settings of the Dask cluster that runs rollout and training."""

from __future__ import annotations

from pydantic import Field, field_validator

from flexmarl.configbase import Strict


class ClusterConfig(Strict):
    address: str | None = None
    """Scheduler address of an existing Dask cluster (``tcp://host:8786``); null starts a LocalCluster."""
    host: str = "127.0.0.1"
    """Interface the LocalCluster's scheduler, workers and dashboard bind to. The default keeps them off the
    network; another value (e.g. '0.0.0.0') lets other hosts reach a cluster whose protocol runs pickled
    code, so only do that on a trusted network (docs/operations.md, Security)."""
    n_workers: int = Field(2, ge=1)
    """Worker processes of the LocalCluster."""
    threads_per_worker: int = Field(1, ge=1)
    """Threads per worker; torch also gets this many threads (more than the cores makes timings erratic)."""
    worker_python: str | None = None
    """The Python the LocalCluster's workers run, from another environment than the driver's: e.g.
    '.venv-vllm/bin/python' (`make setup-vllm`), whose vLLM cannot sit beside Prefect, to train with
    ``rollout.backend: vllm`` through the flow. Its workers start as ``dask worker`` processes joining a
    scheduler in the driver; both environments must hold the same Python, dask, distributed, cloudpickle and
    torch (checked before the run). null: the driver's own Python."""
    memory_limit: str = "auto"
    """Per-worker memory limit of the LocalCluster: 'auto' (the machine's memory shared by the workers), a size
    such as '6GiB' or '500MB', a byte count, or a fraction of the machine's memory in (0, 1] such as '0.5'."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for the scheduler and its workers, for freeing a run's engines at its end, and for a live
    worker to rebuild a lost worker's engines on, before the run fails."""
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    """A worker whose heartbeat the scheduler has not seen for this long counts as hung (a frozen process or
    host): its nanny kills it and the run rebuilds its replicas and trainers elsewhere. Judged only once the
    worker has run a task of the run (a fresh worker importing torch may not heartbeat for many seconds)."""
    worker_resources: dict[str, float] = {}
    """Dask resources every LocalCluster worker offers (e.g. ``{GPU: 1}``); existing clusters declare their own
    (``dask worker --resources "GPU=1"``)."""
    rollout_resource: str | None = None
    """Only workers offering this Dask resource host rollout replicas (e.g. 'rollout' or 'GPU'); null: any."""
    train_resource: str | None = None
    """Only workers offering this Dask resource host trainers (e.g. 'train' or 'GPU'); null: any."""

    def worker_memory_bytes(self) -> int | None:
        """A LocalCluster worker's memory limit in bytes, as Dask will set it; None for a cluster at ``address``,
        whose workers declare their own."""
        if self.address is not None:
            return None
        from dask.utils import parse_bytes
        from distributed.system import MEMORY_LIMIT  # the machine's memory, or its cgroup's limit

        if self.memory_limit == "auto":
            return MEMORY_LIMIT // self.n_workers
        try:
            number = float(self.memory_limit)
        except ValueError:
            return parse_bytes(self.memory_limit)
        return int(number * MEMORY_LIMIT) if number <= 1 else int(number)

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory_parses(cls, limit: object) -> str:
        # Dask would only fail on this inside LocalCluster, after the Prefect server and the flow have started
        fix = "write a size such as '6GiB' or '500MB', a fraction of memory such as 0.5, or 'auto'"
        if isinstance(limit, bool) or not isinstance(limit, str | int | float):
            raise ValueError(f"must be a memory size; {fix}")
        text = str(limit).strip()
        if text == "auto":
            return text
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None:
            if not (0 < number <= 1 or (number > 1 and number.is_integer())):
                raise ValueError(f"{text!r} is neither a fraction in (0, 1] nor a whole number of bytes; {fix}")
            return text
        from dask.utils import parse_bytes  # only for a size: reading a finished run's config imports no Dask

        try:
            size = parse_bytes(text)
        except (ValueError, TypeError):
            raise ValueError(f"{text!r} is not a memory size; {fix}") from None
        if size <= 0:
            raise ValueError(f"{text!r} is not a positive memory size; {fix}")
        return text

    @field_validator("address")
    @classmethod
    def _address_parses(cls, address: str | None) -> str | None:
        if address is None:
            return None
        from distributed.comm import parse_address, parse_host_port  # distributed's own rules
        from distributed.comm.registry import backends

        try:
            scheme, location = parse_address(address)
            if scheme not in backends:
                raise ValueError(f"unknown scheme {scheme!r}; known: {sorted(backends)}")
            if scheme in ("tcp", "tls"):
                parse_host_port(location)
        except ValueError as exc:
            raise ValueError(f"{address!r} is not a Dask scheduler address ({exc}); write it as tcp://host:8786")
        return address
