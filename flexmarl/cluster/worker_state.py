"""Engines that live on a Dask worker between tasks (rollout replicas, trainers).

Each worker keeps its engines in a dict attached to the worker object, so thread-based test clusters
(several workers in one process) keep them apart. Outside a worker (plain Python, tests) a process-wide
dict is used. Engines are a cache of durable state: weights come from model directories or checkpoints and
samples from the store, so a lost worker loses nothing that cannot be rebuilt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from distributed import get_worker

_LOCAL: dict[str, Any] = {}


def engines() -> dict[str, Any]:
    """The calling worker's engine registry."""
    try:
        worker = get_worker()
    except ValueError:  # not inside a Dask task
        return _LOCAL
    registry = getattr(worker, "_flexmarl_engines", None)
    if registry is None:
        registry = worker._flexmarl_engines = {}
        _limit_threads()
    return registry


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
    registry = engines() if dask_worker is None else getattr(dask_worker, "_flexmarl_engines", {})
    keys = [k for k in registry if k.startswith(prefix)]
    for k in keys:
        close = getattr(registry.pop(k), "close", None)
        if callable(close):  # a trainer lets go of what the process-wide Accelerator holds for it
            close()
    return len(keys)
