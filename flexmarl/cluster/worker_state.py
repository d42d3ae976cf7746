"""Engines that live on a Dask worker between tasks (rollout replicas, trainers).

Each worker keeps its engines in an ``EngineRegistry``, a Dask ``WorkerPlugin`` that ``register`` installs
on every worker of a cluster, and that Dask installs again on each worker a nanny restarts; thread-based test
clusters (several workers in one process) get one registry per worker. Its ``teardown`` frees the engines
when the worker closes. Outside a worker (plain Python, tests) a process-wide registry is used. Engines are a
cache of durable state: weights come from model directories or checkpoints and samples from the store, so a lost
worker loses nothing that cannot be rebuilt.

A run that ends releases its engines while a task it cancelled may still be queued or running on a worker
(Dask cannot stop a running task). The registry keeps the released keys, so such a task ends quietly
(``EngineReleased``, which ``timed_call`` turns into an empty result nobody waits for) instead of filling the
worker's log with a traceback about an engine that "was never started".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from distributed import Client, WorkerPlugin, get_worker

PLUGIN = "flexmarl-engines"


@dataclass(frozen=True)
class EngineKey:
    """Names an agent's engines of one run on a worker (its replica, its trainer, what is read ahead for it).

    Registry entries are ``"<kind>:<key>"``, so that a run's release (``release``) frees every engine of the run
    by the prefix ``"<kind>:<run id>/"``.
    """

    run_id: str
    agent: str
    scope: str = ""  # a second engine of the agent besides its own: "~replay", a trainer that rebuilds a state

    def __str__(self) -> str:
        return "/".join(part for part in (self.run_id, self.scope, self.agent) if part)


@dataclass(frozen=True)
class Timed:
    """What a job returned on its worker, and when it ran there (wall clock)."""

    value: Any
    start: float
    end: float
    worker: str


class EngineReleased(LookupError):
    """The engine was released by its run's end: the task asking for it has no one waiting for its result."""


class Engines(dict):
    """A worker's engines by key, and the keys its runs released."""

    def __init__(self) -> None:
        super().__init__()
        self.released: set[str] = set()

    def __setitem__(self, key: str, value: Any) -> None:
        self.released.discard(key)  # started again (a resumed run on the same cluster)
        super().__setitem__(key, value)

    def replace(self, key: str, engine: Any) -> None:
        """Put ``engine`` under ``key``, closing the one it replaces (a rebuilt trainer or replica)."""
        old = self.get(key)
        self[key] = engine
        close = getattr(old, "close", None)
        if old is not engine and callable(close):
            close()

    def get_or_start(self, key: str, start: Callable[[], Any]) -> Any:
        """The engine under ``key``, started with ``start()`` first if there is none (a shared base model)."""
        if key not in self:
            self[key] = start()
        return self[key]

    def lookup(self, key: str, missing: str) -> Any:
        """The engine under ``key``; ``EngineReleased`` if its run released it, else ``RuntimeError(missing)``."""
        try:
            return self[key]
        except KeyError:
            if key in self.released:
                raise EngineReleased(key) from None
            raise RuntimeError(missing) from None

    def release(self, keys: list[str]) -> None:
        for k in keys:
            close = getattr(self.pop(k), "close", None)
            self.released.add(k)
            if callable(close):  # a trainer lets go of what the process-wide Accelerator holds for it
                close()


_LOCAL = Engines()


class EngineRegistry(WorkerPlugin):
    """The engines of one worker, by key."""

    name = PLUGIN
    idempotent = True  # a second client of the cluster (a resumed run) keeps the registry, and its engines

    def setup(self, worker: Any) -> None:
        self.engines = Engines()
        _limit_threads()

    def teardown(self, worker: Any) -> None:
        self.engines.release(list(self.engines))


def register(client: Client) -> None:
    """Install the engine registry on every worker of ``client``'s cluster (and on those that join later)."""
    client.register_plugin(EngineRegistry())


def engines() -> Engines:
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


def timed_call(fn: Callable[..., Any], *args: Any) -> Timed:
    """Run ``fn(*args)`` on this worker; return its value, when it ran, and where.

    A job whose engine its run has released returns None: the run ended, and nobody reads the value.
    """
    start = time.time()
    try:
        value = fn(*args)
    except EngineReleased:
        value = None
    return Timed(value, start, time.time(), worker_address())


def release(prefix: str, dask_worker: Any = None) -> int:
    """Drop this worker's engines whose key starts with ``prefix`` (a finished run); returns how many.

    Meant for ``client.run(release, prefix)``, which passes the worker as ``dask_worker``.
    """
    if dask_worker is None:
        registry = engines()
    else:
        plugin = dask_worker.plugins.get(PLUGIN)
        registry = plugin.engines if plugin is not None else Engines()
    keys = [k for k in registry if k.startswith(prefix)]
    registry.release(keys)
    return len(keys)
