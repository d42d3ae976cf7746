"""Functions that run on a Dask worker (a training slot) to host and drive agents' trainers.

A trainer reads its micro-batches from the store itself, pinned to the Delta version the driver names, so
only a store URI, version numbers and sample ids travel with a job, never tensors. Trainers live in the
worker's engine registry under their ``EngineKey``. The trainers of a run's adapter agents on one worker share
one base model per model directory (an ``AdapterHost``, under ``adapters.host_key``). What a job returns is a
frozen record (``MicroBatchTrained``, ``StateResumed``).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from flexmarl.cluster.worker_state import EngineKey, engines, worker_address
from flexmarl.models.adapters import AdapterHost, host_key
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import (
    TrainerGroup, all_reduce, drop_group, join_world, process_group,
)
from flexmarl.training.state import DEVICE, HOST, HostCopy, TrainingState
from flexmarl.training.trainer import AgentTrainer, TrainBatch, UpdateResult, shared_accelerator
from storage.store import StoreSpec


@dataclass(frozen=True)
class MicroBatchTrained:
    """A micro-batch's forward/backward on its slot."""

    metrics: dict[str, float]  # the trainer's loss statistics of the micro-batch
    swap_s: float  # bringing the agent's state onto the device first
    read_s: float  # reading the micro-batch from the store


@dataclass(frozen=True)
class Interval:
    start: float  # wall clock
    end: float


@dataclass(frozen=True)
class StateResumed:
    """An agent's state resumed on this slot (the second half of a state move)."""

    worker: str
    load_s: float  # bringing the state into the new trainer: a read and a copy, or only the copy after a prefetch
    prefetch: Interval | None  # the background read that brought it into host memory ahead, if one did


@dataclass(frozen=True)
class _Prefetching:
    location: str
    read: Future  # of a ``_ReadAhead``


@dataclass(frozen=True)
class _ReadAhead:
    copy: HostCopy
    took: Interval


def _key(key: EngineKey | str) -> str:
    return f"trainer:{key}"


def gather_weights(key: EngineKey) -> None:
    """Gather an FSDP2 trainer's whole weights onto its home (rank 0), kept there by the trainer for the weight
    syncs, the snapshot and the checkpoint; every rank calls it at once, within the job that changed the weights,
    so that no other collective of the ranks comes between (a sync's fetch then needs only the home)."""
    trainer(key).weights()


def _prefetch_key(key: EngineKey) -> str:
    return f"prefetch:{key}"


def build_trainer(
    key: EngineKey, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, version: int = 0,
    group: TrainerGroup | None = None,
) -> AgentTrainer:
    """A new trainer of ``key``'s agent (not registered); an adapter agent's adds its adapter to the base this
    worker shares among the run's adapter agents of that model. A sharded agent's (``training.sharding``)
    is this worker's rank of ``group``: every member builds its own at once."""
    host = mesh = None
    if config.adapter is not None:
        device = shared_accelerator(config.mixed_precision).device
        host = engines().get_or_start(_key(host_key(key, model_dir)), lambda: AdapterHost(model_dir, device))
    if config.sharded:
        if group is None:
            raise ValueError(f"agent {key.agent!r} trains sharded: its trainer is built by every rank of a group")
        mesh = join_world(group)
    return AgentTrainer(key.agent, model_dir, config, temperature=temperature, max_new_tokens=max_new_tokens,
                        version=version, host=host, mesh=mesh)


def install(key: EngineKey, trainer: AgentTrainer) -> None:
    """Make ``trainer`` the one of ``key`` on this worker, closing any it replaces. A sharded trainer's ranks all
    install theirs at once, and its whole weights are gathered onto its home (``gather_weights``)."""
    engines().replace(_key(key), trainer)
    if trainer.fsdp:
        gather_weights(key)


def start_trainer(
    key: EngineKey, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, version: int,
    group: TrainerGroup | None = None,
) -> str:
    if _key(key) not in engines():
        install(key, build_trainer(key, model_dir, config, temperature, max_new_tokens, version, group))
    return worker_address()


def trainer(key: EngineKey) -> AgentTrainer:
    return engines().lookup(_key(key), f"no trainer {str(key)!r} on worker {worker_address()}")


def activate(key: EngineKey) -> float:
    """Put ``key``'s state on this slot's device, moving the previous agent's to host memory first.

    Returns the seconds spent swapping. On a CPU-only worker device and host are the same memory and
    nothing moves.
    """
    registry = engines()
    holder = registry.get("slot:on-device")  # the EngineKey whose state is on the device
    if holder == key or not torch.cuda.is_available():
        registry["slot:on-device"] = key
        return 0.0
    start = time.perf_counter()
    if holder is not None and _key(holder) in registry:
        TrainingState.of(registry[_key(holder)]).to(HOST)
    TrainingState.of(trainer(key)).to(DEVICE)
    registry["slot:on-device"] = key
    return time.perf_counter() - start


def park(key: EngineKey, location: str, storage_options: dict) -> int:
    """Write ``key``'s whole training state to ``location`` (a directory or URI); returns the bytes written.

    The trainer stays on this worker until ``drop_trainer``: if the agent comes back here before it trains
    anywhere else, nothing needs to be read back. The scheduler parks a trainer in the middle of a step only
    for a rank that joins its group (the state of the step's start; this trainer keeps its gradient sum): a
    state moves between steps. A sharded trainer's ranks all call this at once, between steps, each writing its
    shards; each returns its own bytes.
    """
    held = trainer(key)
    if held.mesh is not None:
        state = TrainingState.of(held).to(location)
        return state.stored_bytes
    copy = HostCopy.capture(held, during_step=True)
    try:
        return copy.write(location, storage_options)
    finally:
        copy.release()


def drop_trainer(key: EngineKey) -> bool:
    """Free ``key``'s trainer here once its state was resumed on another worker; True when there was one."""
    registry = engines()
    if registry.get("slot:on-device") == key:
        del registry["slot:on-device"]
    dropped = registry.pop(_key(key), None)
    drop_group(key)
    if dropped is not None:
        dropped.close()
    return dropped is not None


def _read_ahead(location: str, storage_options: dict) -> _ReadAhead:
    start = time.time()
    copy = HostCopy.read(location, storage_options)
    return _ReadAhead(copy, Interval(start, time.time()))


def prefetch(key: EngineKey, location: str, storage_options: dict, _after: object = None) -> None:
    """Start reading ``key``'s parked state from ``location`` into this worker's host memory, in a background
    thread, and return at once: the slot keeps training its current agent meanwhile, and a later
    ``resume`` of ``key`` here finds the state in memory (``_after``: the park's result)."""
    registry = engines()
    pool = registry.get_or_start("slot:prefetcher",
                                 lambda: ThreadPoolExecutor(1, thread_name_prefix="flexmarl-prefetch"))
    registry[_prefetch_key(key)] = _Prefetching(location, pool.submit(_read_ahead, location, storage_options))


def discard_prefetch(key: EngineKey) -> bool:
    """Drop a prefetched state of ``key`` that another slot resumed instead; True when there was one."""
    return engines().pop(_prefetch_key(key), None) is not None


def resume(
    key: EngineKey, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, location: str,
    version: int, _after: object = None, group: TrainerGroup | None = None,
) -> StateResumed:
    """Rebuild ``key``'s trainer on this worker from the state parked at ``location`` (``_after``: the park's
    or the prefetch's result, so that Dask runs this only after it).

    Takes the prefetched host copy when ``prefetch`` read that location here; otherwise reads it now. A sharded
    agent's ranks of ``group`` all call this at once and read their shards, whatever the number of ranks that
    wrote them.

    Raises:
        RuntimeError: the state found is not at ``version`` (a stale state at ``location``).
    """
    fresh = build_trainer(key, model_dir, config, temperature, max_new_tokens, group=group)
    pending: _Prefetching | None = engines().pop(_prefetch_key(key), None)
    load_start = time.perf_counter()
    prefetched = None
    if pending is not None and pending.location == location:
        ahead: _ReadAhead = pending.read.result()  # re-raises a failed read here
        if ahead.copy.version == version:
            prefetched = ahead.took
            state = TrainingState(key.agent, HOST, copy=ahead.copy)
    if prefetched is None:
        state = TrainingState.at(key.agent, location, storage_options=config.state_storage_options)
    state.to(DEVICE, trainer=fresh)
    load_s = time.perf_counter() - load_start
    if fresh.version != version:
        fresh.close()
        raise RuntimeError(f"the state of {key.agent!r} at {location} is at v{fresh.version}, expected v{version}")
    install(key, fresh)
    return StateResumed(worker_address(), load_s, prefetched)


def accumulate(key: EngineKey, store: StoreSpec, samples_version: int, sample_ids: list[str],
               step: int) -> MicroBatchTrained:
    """Forward/backward of one committed micro-batch of ``step`` (read at a pinned Delta version)."""
    swap_s = activate(key)
    t = trainer(key)
    if t.version > step:
        raise RuntimeError(f"trainer {str(key)!r} is at v{t.version}, past step {step}: refusing to train twice")
    read_start = time.perf_counter()
    rows = store.open().read_micro_batch(key.agent, sample_ids, version=samples_version)
    read_s = time.perf_counter() - read_start
    if rows.num_rows != len(sample_ids):
        raise RuntimeError(
            f"micro-batch of {key.agent!r} step {step}: {len(sample_ids)} samples expected at Delta version "
            f"{samples_version}, {rows.num_rows} found"
        )
    return MicroBatchTrained(t.accumulate(TrainBatch.from_arrow(rows)), swap_s, read_s)


def finish_step(key: EngineKey, group: TrainerGroup | None = None) -> UpdateResult:
    """The optimizer step of ``key``'s update; with a ``group``, this worker's rank of the group's collective
    step (every member runs this at once)."""
    activate(key)
    held = trainer(key)
    if held.mesh is not None:
        result = held.finish_step()
        if held.fsdp:
            gather_weights(key)
        return result
    if group is None:
        return held.finish_step()
    pg = process_group(key, group)
    return held.finish_step(reduce=lambda tensors: all_reduce(pg, tensors))


def weights(key: EngineKey) -> dict[str, torch.Tensor]:
    """The trainer's weights, on the CPU; an FSDP2 trainer's as its home gathered them after its last change (a
    ZeRO-1 trainer's home holds them whole)."""
    held = trainer(key)
    return held.gathered_weights() if held.fsdp else held.weights()


def weights_in_place(key: EngineKey, version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights of ``version`` where they are, not copied (on its device; an FSDP2 trainer's as its
    home gathered them), for a rollout engine on this worker to copy into its own: a weight sync that never
    leaves the device. Raises ``RuntimeError`` when the trainer is at another version."""
    held = trainer(key)
    if held.version != version:
        raise RuntimeError(f"trainer {str(key)!r} is at v{held.version}, not v{version}: no weights of v{version} "
                           "to sync here")
    return held.weights_in_place()


def save_checkpoint(key: EngineKey, out_dir: str, tokenizer_dir: str) -> str:
    """Save the agent's weights and its tokenizer as a loadable Hugging Face directory (a sharded trainer's, as
    its home gathered them)."""
    held = trainer(key)
    out = held.save(out_dir, weights(key) if held.mesh is not None else None)
    for f in Path(tokenizer_dir).glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return str(out)
