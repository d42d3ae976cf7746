"""Engines that live on a Dask worker between tasks (rollout replicas, trainers).

Each worker keeps its engines in an ``EngineRegistry``, a Dask ``WorkerPlugin`` that ``register`` installs
on every worker of a cluster, and that Dask installs again on each worker a nanny restarts; thread-based test
clusters (several workers in one process) get one registry per worker. Its ``teardown`` frees the engines
when the worker closes. Outside a worker (plain Python, tests) a process-wide dict is used. Engines are a cache of durable state: weights come from model directories or checkpoints and
samples from the store, so a lost worker loses nothing that cannot be rebuilt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from distributed import Client, WorkerPlugin, get_worker

PLUGIN = "flexmarl-engines"
_LOCAL: dict[str, Any] = {}


class EngineRegistry(WorkerPlugin):
    """The engines of one worker, by key."""

    name = PLUGIN
    idempotent = True  # a second client of the cluster (a resumed run) keeps the registry, and its engines

    def setup(self, worker: Any) -> None:
        self.engines: dict[str, Any] = {}
        _limit_threads()

    def teardown(self, worker: Any) -> None:
        _close(self.engines, list(self.engines))


def register(client: Client) -> None:
    """Install the engine registry on every worker of ``client``'s cluster (and on those that join later)."""
    client.register_plugin(EngineRegistry())


def engines() -> dict[str, Any]:
    """The calling worker's engine registry.

    Raises:
        RuntimeError: inside a worker of a cluster whose registry was never installed (``register``).
    """
    try:
        worker = get_worker()
    except ValueError:  # not inside a Dask task
        return _LOCAL
    plugin = worker.plugins.get(PLUGIN)
    if plugin is None:
        raise RuntimeError(f"worker {worker.address} has no FlexMARL engine registry: connect to the cluster with "
                           "flexmarl.cluster.local.connect, or call flexmarl.cluster.worker_state.register(client)")
    return plugin.engines


def worker_address() -> str:
    try:
        return get_worker().address
    except ValueError:
        return "local"


def _limit_threads() -> None:
    # One torch thread per worker thread: more threads than cores makes timings erratic on small machines.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float, str]:
    """Run ``fn(*args)`` on this worker; return its value, wall-clock start and end, and the worker."""
    start = time.time()
    value = fn(*args)
    return value, start, time.time(), worker_address()


def release(prefix: str, dask_worker: Any = None) -> int:
    """Drop this worker's engines whose key starts with ``prefix`` (a finished run); returns how many.

    Meant for ``client.run(release, prefix)``, which passes the worker as ``dask_worker``.
    """
    if dask_worker is None:
        registry = engines()
    else:
        plugin = dask_worker.plugins.get(PLUGIN)
        registry = plugin.engines if plugin is not None else {}
    keys = [k for k in registry if k.startswith(prefix)]
    _close(registry, keys)
    return len(keys)


def _close(registry: dict[str, Any], keys: list[str]) -> None:
    for k in keys:
        close = getattr(registry.pop(k), "close", None)
        if callable(close):  # a trainer lets go of what the process-wide Accelerator holds for it
            close()
