"""Functions that run on a Dask worker (a training slot) to host and drive agents' trainers.

A trainer reads its micro-batches from the store itself, pinned to the Delta version the driver names, so
only a store URI, version numbers and sample ids travel with a task, never tensors. Trainers live in the
worker's engine registry under ``key`` (``"<run id>/<agent>"``). The trainers of a run's adapter agents on one
worker share one base model per model directory (an ``AdapterHost``, under ``adapters.host_key``).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flexmarl.cluster.worker_state import engines, worker_address
from flexmarl.models.adapters import AdapterHost, host_key
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import DEVICE, HOST, HostCopy, TrainingState
from flexmarl.training.trainer import AgentTrainer, TrainBatch, UpdateResult, shared_accelerator
from storage.store import StoreSpec


def _key(key: str) -> str:
    return f"trainer:{key}"


def _prefetch_key(key: str) -> str:
    return f"prefetch:{key}"


def build_trainer(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, version: int = 0
) -> AgentTrainer:
    """A new trainer of ``key``'s agent (not registered); an adapter agent's adds its adapter to the base this
    worker shares among the run's adapter agents of that model."""
    agent = key.rsplit("/", 1)[-1]
    host = None
    if config.adapter is not None:
        device = shared_accelerator(config.mixed_precision).device
        host = engines().get_or_start(_key(host_key(key, model_dir)), lambda: AdapterHost(model_dir, device))
    return AgentTrainer(agent, model_dir, config, temperature=temperature, max_new_tokens=max_new_tokens,
                        version=version, host=host)


def install(key: str, trainer: AgentTrainer) -> None:
    """Make ``trainer`` the one of ``key`` on this worker, closing any it replaces."""
    engines().replace(_key(key), trainer)


def start_trainer(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, version: int
) -> str:
    if _key(key) not in engines():
        install(key, build_trainer(key, model_dir, config, temperature, max_new_tokens, version))
    return worker_address()


def trainer(key: str) -> AgentTrainer:
    return engines().lookup(_key(key), f"no trainer {key!r} on worker {worker_address()}")


def activate(key: str) -> float:
    """Put ``key``'s state on this slot's device, moving the previous agent's to host memory first.

    Returns the seconds spent swapping. On a CPU-only worker device and host are the same memory and
    nothing moves.
    """
    registry = engines()
    holder = registry.get("slot:on-device")
    if holder == key or not torch.cuda.is_available():
        registry["slot:on-device"] = key
        return 0.0
    start = time.perf_counter()
    if holder is not None and _key(holder) in registry:
        TrainingState.of(registry[_key(holder)]).to(HOST)
    TrainingState.of(trainer(key)).to(DEVICE)
    registry["slot:on-device"] = key
    return time.perf_counter() - start


def park(key: str, location: str, storage_options: dict) -> int:
    """Write ``key``'s whole training state to ``location`` (a directory or URI); returns the bytes written.

    The trainer stays on this worker until ``drop_trainer``: if the agent comes back here before it trains
    anywhere else, nothing needs to be read back.
    """
    return TrainingState.of(trainer(key)).to(location, storage_options=storage_options).stored_bytes


def drop_trainer(key: str) -> bool:
    """Free ``key``'s trainer here once its state was resumed on another worker; True when there was one."""
    registry = engines()
    if registry.get("slot:on-device") == key:
        del registry["slot:on-device"]
    dropped = registry.pop(_key(key), None)
    if dropped is not None:
        dropped.close()
    return dropped is not None


def _read_ahead(location: str, storage_options: dict) -> tuple[HostCopy, float, float]:
    start = time.time()
    copy = HostCopy.read(location, storage_options)
    return copy, start, time.time()


def prefetch(key: str, location: str, storage_options: dict, _after: object = None) -> None:
    """Start reading ``key``'s parked state from ``location`` into this worker's host memory, in a background
    thread, and return at once: the slot keeps training its current agent meanwhile, and a later
    ``resume`` of ``key`` here finds the state in memory (``_after``: the park's result)."""
    registry = engines()
    pool = registry.get_or_start("slot:prefetcher",
                                 lambda: ThreadPoolExecutor(1, thread_name_prefix="flexmarl-prefetch"))
    registry[_prefetch_key(key)] = (location, pool.submit(_read_ahead, location, storage_options))


def discard_prefetch(key: str) -> bool:
    """Drop a prefetched state of ``key`` that another slot resumed instead; True when there was one."""
    return engines().pop(_prefetch_key(key), None) is not None


def resume(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, location: str,
    version: int, _after: object = None,
) -> dict:
    """Rebuild ``key``'s trainer on this worker from the state parked at ``location`` (``_after``: the park's
    or the prefetch's result, so that Dask runs this only after it).

    Takes the prefetched host copy when ``prefetch`` read that location here; otherwise reads it now.
    Returns the worker, ``load_s`` (seconds bringing the state into the trainer: a read and a copy, or only
    the copy after a prefetch) and ``prefetch`` (wall-clock start and end of the background read, or None).

    Raises:
        RuntimeError: the state found is not at ``version`` (a stale state at ``location``).
    """
    agent = key.rsplit("/", 1)[-1]
    fresh = build_trainer(key, model_dir, config, temperature, max_new_tokens)
    pending = engines().pop(_prefetch_key(key), None)
    load_start = time.perf_counter()
    prefetched = None
    if pending is not None and pending[0] == location:
        copy, started, ended = pending[1].result()  # re-raises a failed read here
        if copy.version == version:
            prefetched = (started, ended)
            state = TrainingState(agent, HOST, copy=copy)
    if prefetched is None:
        state = TrainingState.at(agent, location, storage_options=config.state_storage_options)
    state.to(DEVICE, trainer=fresh)
    load_s = time.perf_counter() - load_start
    if fresh.version != version:
        fresh.close()
        raise RuntimeError(f"the state of {agent!r} at {location} is at v{fresh.version}, expected v{version}")
    install(key, fresh)
    return {"worker": worker_address(), "load_s": load_s, "prefetch": prefetched}


def accumulate(key: str, store: StoreSpec, samples_version: int, sample_ids: list[str], step: int) -> dict:
    """Forward/backward of one committed micro-batch of ``step`` (read at a pinned Delta version).

    Returns the loss statistics, ``swap_s`` (bringing the state onto the device) and ``read_s`` (the
    store read).
    """
    swap_s = activate(key)
    t = trainer(key)
    if t.version > step:
        raise RuntimeError(f"trainer {key!r} is at v{t.version}, past step {step}: refusing to train twice")
    agent = key.rsplit("/", 1)[-1]
    read_start = time.perf_counter()
    rows = store.open().read_micro_batch(agent, sample_ids, version=samples_version)
    read_s = time.perf_counter() - read_start
    if rows.num_rows != len(sample_ids):
        raise RuntimeError(
            f"micro-batch of {agent!r} step {step}: {len(sample_ids)} samples expected at Delta version "
            f"{samples_version}, {rows.num_rows} found"
        )
    return {**t.accumulate(TrainBatch.from_arrow(rows)), "swap_s": swap_s, "read_s": read_s}


def finish_step(key: str) -> UpdateResult:
    activate(key)
    return trainer(key).finish_step()


def weights(key: str) -> dict[str, torch.Tensor]:
    return trainer(key).weights()


def save_checkpoint(key: str, out_dir: str, tokenizer_dir: str) -> str:
    """Save the agent's weights and its tokenizer as a loadable Hugging Face directory."""
    out = trainer(key).save(out_dir)
    for f in Path(tokenizer_dir).glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return str(out)
