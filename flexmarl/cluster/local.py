"""Starting or reaching the Dask cluster, and placing agents on its workers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import dask
from distributed import Client, Future, LocalCluster
from distributed.comm import connect as comm_connect, parse_address, parse_host_port

from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.worker_python import probe, worker_command


class ClusterError(RuntimeError):
    """The Dask cluster cannot be started or reached; the message names the address and the fix."""


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for worker processes: one torch thread each, no hub access."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update(extra or {})
    return env


# A LocalCluster hard-closes the nanny of a worker that has not re-registered 15 s (Dask's default) after it was
# lost, even while that nanny is restarting it: a restart slower than that on a busy machine (spawn, import torch)
# lost the worker for good ("Worker process still alive after 4.0 seconds, killing", then no worker; issue 31).
# A nanny that cannot start its worker closes itself, and a run waits for workers only cluster.connect_timeout_s.
LOST_WORKER_TIMEOUT = "1h"


@contextmanager
def open_cluster(cfg: ClusterConfig, *, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield a scheduler address: ``cfg.address`` after checking that it answers, or a LocalCluster's.

    A LocalCluster started here binds to ``cfg.host`` (127.0.0.1) and is closed on exit.
    """
    if cfg.address:
        with connect(cfg.address, timeout_s=cfg.connect_timeout_s):
            pass
        yield cfg.address
        return
    if cfg.worker_python:
        with _foreign_workers(cfg, env) as address:
            yield address
        return
    with dask.config.set({"distributed.deploy.lost-worker-timeout": LOST_WORKER_TIMEOUT}):
        with _local_cluster(cfg, env) as cluster:
            yield cluster.scheduler_address


@contextmanager
def _local_cluster(cfg: ClusterConfig, env: dict[str, str] | None) -> Iterator[LocalCluster]:
    try:
        cluster = LocalCluster(
            n_workers=cfg.n_workers,
            threads_per_worker=cfg.threads_per_worker,
            processes=True,
            host=cfg.host,  # scheduler and workers: 127.0.0.1 unless told otherwise
            dashboard_address=f"{cfg.host}:0",  # never the shared default port 8787
            # Dask's own 'auto' is a share per thread of all the cores: 1/16 of the memory each for 2 workers of
            # one thread on a 16-core GPU machine, where the documented 'auto' is the machine shared by the workers
            memory_limit=cfg.worker_memory_bytes(),
            resources=cfg.worker_resources or None,
            env=worker_env({**(env or {}), "OMP_NUM_THREADS": str(cfg.threads_per_worker)}),
        )
    except Exception as exc:
        raise ClusterError(f"cannot start a LocalCluster of {cfg.n_workers} workers: {exc}") from exc
    # the scheduler lives in this process: its per-connection INFO lines would drown the run's progress
    logging.getLogger("distributed").setLevel(logging.WARNING)
    try:
        yield cluster
    finally:
        _close_workers(cluster, WORKER_EXIT_S)
        cluster.close()


@contextmanager
def _foreign_workers(cfg: ClusterConfig, env: dict[str, str] | None) -> Iterator[str]:
    """A scheduler in this process and ``cfg.n_workers`` ``dask worker`` processes of ``cfg.worker_python``."""
    probe(cfg.worker_python)
    try:
        cluster = LocalCluster(n_workers=0, processes=True, host=cfg.host, dashboard_address=f"{cfg.host}:0")
    except Exception as exc:
        raise ClusterError(f"cannot start a Dask scheduler on {cfg.host}: {exc}") from exc
    logging.getLogger("distributed").setLevel(logging.WARNING)
    environ = {**os.environ, **worker_env({**(env or {}), "OMP_NUM_THREADS": str(cfg.threads_per_worker)})}
    with tempfile.TemporaryDirectory(prefix="flexmarl-workers-") as logs, cluster:
        workers = []
        try:
            for i in range(cfg.n_workers):
                with open(Path(logs) / f"worker-{i}.log", "wb") as log:
                    workers.append(subprocess.Popen(worker_command(cfg, cluster.scheduler_address, f"worker-{i}"),
                                                    env=environ, stdout=log, stderr=subprocess.STDOUT))
            with Client(cluster, set_as_default=False) as client:
                try:
                    client.wait_for_workers(cfg.n_workers, timeout=cfg.connect_timeout_s)
                except TimeoutError:
                    tail = (Path(logs) / "worker-0.log").read_text(errors="replace").strip().splitlines()[-1:]
                    raise ClusterError(
                        f"{cfg.n_workers} workers of {cfg.worker_python} did not join within "
                        f"{cfg.connect_timeout_s:.0f}s (cluster.connect_timeout_s); a worker said: "
                        f"{tail[0] if tail else 'nothing'}"
                    ) from None
            yield cluster.scheduler_address
        finally:
            for worker in workers:
                worker.terminate()  # `dask worker` closes its worker and nanny on SIGTERM
            for worker in workers:
                try:
                    worker.wait(timeout=WORKER_EXIT_S)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()


# A worker that has loaded torch and models can take several seconds to exit on a busy machine; Dask's nanny
# waits 4 s, then kills it with a warning on every clean shutdown. Waiting longer keeps the exit clean.
WORKER_EXIT_S = 20.0


def _close_workers(cluster: LocalCluster, timeout_s: float) -> None:
    """Ask every worker of ``cluster`` to exit, killing one only after ``timeout_s`` (0.8 of it, as Dask does)."""

    async def close_all() -> None:
        nannies = list(cluster.workers.values())
        await asyncio.gather(*(n.close(timeout=timeout_s) for n in nannies), return_exceptions=True)

    try:
        cluster.sync(close_all)
    except Exception as exc:  # noqa: BLE001 - cluster.close() below still ends every worker
        logging.getLogger(__name__).debug("closing the workers of %s: %s", cluster.scheduler_address, exc)


def connect(address: str, *, timeout_s: float, n_workers: int = 1) -> Client:
    """A client of the scheduler at ``address`` with at least ``n_workers`` workers, within ``timeout_s`` each.

    Raises:
        ClusterError: naming the address, the wait and the fix.
    """
    fix = "check cluster.address (--dask-address) or start the scheduler (`dask scheduler`)"
    _probe(address, timeout_s, fix)
    _handshake(address, timeout_s, fix)
    try:
        client = Client(address, timeout=f"{timeout_s}s", set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ClusterError(
            f"cannot reach the Dask scheduler at {address} within {timeout_s:.0f}s ({exc}); {fix}"
        ) from None
    except Exception as exc:  # something answered, but not as a Dask scheduler does
        raise ClusterError(
            f"the service at {address} does not answer as a Dask scheduler ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    try:
        client.wait_for_workers(n_workers, timeout=timeout_s)
    except TimeoutError:
        client.close()
        raise ClusterError(
            f"the Dask scheduler at {address} has no workers after {timeout_s:.0f}s (cluster.connect_timeout_s); "
            f"start workers with `dask worker {address}`"
        ) from None
    from flexmarl.cluster.worker_state import register  # here: it imports torch

    register(client)  # every worker, and each one a nanny restarts, keeps its engines in a registry
    return client


def _probe(address: str, timeout_s: float, fix: str) -> None:
    """Fail at once, before a Client exists, when nothing listens at a tcp:// address."""
    scheme, location = parse_address(address)
    if scheme != "tcp":
        return
    host, port = parse_host_port(location)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise ClusterError(
            f"cannot reach the Dask scheduler at {address} within {timeout_s:.0f}s ({reason}); {fix}"
        ) from None


def _handshake(address: str, timeout_s: float, fix: str) -> None:
    """Fail within ``timeout_s`` unless the service at a tcp:// address answers Dask's ``identity`` call as a
    scheduler. ``Client(timeout=...)`` does not bound this: against, say, an HTTP server it waits forever."""
    if parse_address(address)[0] != "tcp":
        return

    async def identity() -> object:
        comm = await comm_connect(address, timeout=timeout_s)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    async def bounded() -> object:
        return await asyncio.wait_for(identity(), timeout_s)

    # its own thread and event loop: the caller may be inside one (a Prefect flow), and asyncio.run needs none
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dask-handshake") as pool:
        try:
            reply = pool.submit(asyncio.run, bounded()).result()
        except (TimeoutError, asyncio.TimeoutError):
            raise ClusterError(
                f"the service at {address} does not answer as a Dask scheduler within {timeout_s:.0f}s "
                f"(cluster.connect_timeout_s); {fix}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - whatever answered spoke another protocol
            raise ClusterError(
                f"the service at {address} does not answer as a Dask scheduler ({type(exc).__name__}); {fix}"
            ) from None
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        what = reply.get("type") if isinstance(reply, dict) else type(reply).__name__
        raise ClusterError(f"the service at {address} is not a Dask scheduler (it answers as {what!r}); {fix}")


def scheduler_workers(client: Client) -> dict[str, dict]:
    """The workers the scheduler knows now (address -> its info), asked of the scheduler itself.

    Not ``client.scheduler_info()``: that returns the client's cached identity, which Dask's periodic refresh
    (every 2 s) overwrites with one that lists no workers; a refresh landing between the fetch and the read
    made every worker look lost (a false recovery that rebuilt both live trainers, 4 minutes of a run).
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def workers_offering(client: Client, resource: str | None, role: str) -> list[str]:
    """Workers that offer ``resource`` (all when None), sorted; a resource nobody offers is an error, not a hang."""
    info = scheduler_workers(client)
    if resource is None:
        return sorted(info)
    offering = sorted(w for w, i in info.items() if i.get("resources", {}).get(resource, 0) > 0)
    if not offering:
        offered = sorted({r for i in info.values() for r in i.get("resources", {})})
        raise ClusterError(
            f"no Dask worker offers resource {resource!r} for {role} (workers offer: {offered or 'none'}); "
            f"start workers with `--resources \"{resource}=1\"` or set cluster.worker_resources"
        )
    return offering


def place(agents: Sequence[str], workers: Sequence[str]) -> dict[str, str]:
    """Agents round-robin over the workers (sorted, so every process computes the same placement)."""
    ordered = sorted(workers)
    return {agent: ordered[i % len(ordered)] for i, agent in enumerate(agents)}


def submit_on(client: Client, worker: str, fn, *args, **kwargs) -> Future:
    """Run ``fn(*args)`` on exactly ``worker`` (where its engines live), never deduplicated by Dask."""
    return client.submit(fn, *args, workers=[worker], allow_other_workers=False, pure=False, **kwargs)
