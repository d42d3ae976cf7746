"""An agent's trainer over several slots: a torch.distributed process group formed on demand.

When the scheduler spreads one agent's step over k training slots, each slot holds a whole copy of the agent's
trainer (data parallel, ``training.sharding: none``) and trains whole micro-batches of the step; the optimizer
step is the collective: every rank adds the others' gradient sums and loss counters (one all-reduce), then
takes the same step, so every rank ends with the same weights.

The group is a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built directly on a ``PrefixStore`` of
the run's rendezvous store, not the process's default group: a worker may serve several agents' groups, each
formed, resized and dropped on its own, which one default world per process cannot do. Ray Train and
dask-pytorch-ddp form their groups the same way over workers that already run (a store, a rank per worker,
no launcher); they then call ``init_process_group``, which allows one group per process.

The driver serves the store (``Rendezvous``: a ``TCPStore`` in the driver's process, which lives as long as
the run); each formation has a name of its own (its key prefix), so a group re-formed after a lost rank
never reads the keys of the one before.

A sharded trainer (``training.sharding``: 'optimizer' or 'full') is the exception: FSDP2's ``DeviceMesh``,
``ZeroRedundancyOptimizer`` and distributed checkpoint read the process's default group, so its ranks join a
*world* (``join_world``: the default group, formed on the same store). A process is in one world at a time:
joining another formation leaves the one before, whose sharded trainers must have been parked first. So a
run's sharded agents share one world (``world_name``): they span the same ranks, and the scheduler lets one of
them at a time run collectives there, in the same order on every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from distributed.utils import get_ip
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flexmarl.cluster.worker_state import EngineKey, engines, worker_address

BUCKET_ELEMENTS = 16 * 2**20
"""Elements per all-reduce call: the gradient sums go in float64 buckets of 128 MB, so that a reduction never
needs a second copy of the whole gradient."""


@dataclass(frozen=True)
class TrainerGroup:
    """One formation of an agent's trainer group: what each rank needs to join it."""

    name: str  # unique per formation: its keys' prefix in the rendezvous store
    members: tuple[str, ...]  # worker addresses in rank order (the agent's home first)
    store: str  # host:port of the run's rendezvous store
    timeout_s: float  # forming and each collective; a rank that never comes fails the others after it

    def rank(self, worker: str) -> int:
        return self.members.index(worker)

    @property
    def size(self) -> int:
        return len(self.members)


class Rendezvous:
    """The run's rendezvous store, served from the driver's process for as long as the object lives."""

    def __init__(self, scheduler_address: str) -> None:
        # the address of the interface that reaches the scheduler: the workers reach the driver there too
        self.host = get_ip(urlparse(scheduler_address).hostname or "127.0.0.1")
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.store.port}"


GROUP = "group"  # the registry's kind of a worker's rank of a group (``free_engines`` releases them too)


def _group_key(key: EngineKey) -> str:
    return f"{GROUP}:{key}"


def process_group(key: EngineKey, group: TrainerGroup) -> dist.ProcessGroup:
    """This worker's rank of ``group`` for ``key``'s agent: formed on first use (every rank must call this), then
    kept until the agent's next formation replaces it."""
    registry = engines()
    held = registry.get(_group_key(key))
    if held is not None and held[0] == group.name:
        return held[1]
    host, port = group.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=group.timeout_s)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    store = dist.PrefixStore(group.name, client)
    rank = group.rank(worker_address())
    if torch.cuda.is_available():
        pg = dist.ProcessGroupNCCL(store, rank, group.size)
    else:
        pg = dist.ProcessGroupGloo(store, rank, group.size, timeout)
    registry[_group_key(key)] = (group.name, pg)
    return pg


WORLD = "world"  # the registry's entry of the sharded formation this process is a rank of


def world_name(run_id: str, formation: int | str) -> str:
    """The name of one formation of a run's sharded world: the run's sharded agents span the same ranks (the same
    ``training.max_slots``) and all live in it, each with its own FSDP2 mesh or ZeRO-1 optimizer over it."""
    return f"{run_id}/{WORLD}/{formation}"


def join_world(group: TrainerGroup) -> DeviceMesh:
    """This process's rank of ``group`` as its default process group, and the one-dimensional mesh over it
    that a sharded trainer's parameters are placed on: formed on first use (every rank calls this at once),
    kept until another formation replaces it."""
    registry = engines()
    held = registry.get(WORLD)
    if held is not None and held[0] == group.name:
        return held[1]
    leave_world()
    host, port = group.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=group.timeout_s)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.PrefixStore(group.name, client),
                            rank=group.rank(worker_address()), world_size=group.size, timeout=timeout)
    mesh = init_device_mesh(device, (group.size,))
    registry[WORLD] = (group.name, mesh)
    return mesh


def leave_world() -> None:
    engines().pop(WORLD, None)
    if dist.is_initialized():
        dist.destroy_process_group()


def world_all_reduce(tensors: list[torch.Tensor]) -> None:
    """``all_reduce`` over this process's world (the default group), in buckets."""
    all_reduce(dist.group.WORLD, tensors)


def drop_group(key: EngineKey) -> None:
    engines().pop(_group_key(key), None)


def all_reduce(pg: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over the group's ranks, in place; each rank passes the same shapes in the same order.

    Tensors of one dtype go flat in buckets of ``BUCKET_ELEMENTS`` (one call per bucket, not per tensor).
    """
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        pg.allreduce([flat]).wait()
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    filled = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or filled + t.numel() > BUCKET_ELEMENTS):
            yield bucket
            bucket, filled = [], 0
        bucket.append(t)
        filled += t.numel()
    if bucket:
        yield bucket
