"""Functions that run on a Dask worker (a training slot) to host and drive agents' trainers.

A trainer reads its micro-batches from the store itself, pinned to the Delta version the driver names, so
only a store URI, version numbers and sample ids travel with a task, never tensors. Trainers live in the
worker's engine registry under ``key`` (``"<run id>/<agent>"``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from flexmarl.cluster.worker_state import engines, worker_address
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import load_state, move, save_state
from flexmarl.training.trainer import AgentTrainer, TrainBatch, UpdateResult
from storage.store import ExperienceStore


def _key(key: str) -> str:
    return f"trainer:{key}"


def start_trainer(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, version: int
) -> str:
    registry = engines()
    if _key(key) not in registry:
        agent = key.rsplit("/", 1)[-1]
        registry[_key(key)] = AgentTrainer(
            agent, model_dir, config, temperature=temperature, max_new_tokens=max_new_tokens, version=version
        )
    return worker_address()


def trainer(key: str) -> AgentTrainer:
    try:
        return engines()[_key(key)]
    except KeyError:
        raise RuntimeError(f"no trainer {key!r} on worker {worker_address()}") from None


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
        move(registry[_key(holder)], "host")
    move(trainer(key), "device")
    registry["slot:on-device"] = key
    return time.perf_counter() - start


def park(key: str, state_dir: str) -> int:
    """Write ``key``'s whole training state to ``state_dir`` and drop it from this worker; returns bytes."""
    registry = engines()
    written = save_state(trainer(key), Path(state_dir))
    del registry[_key(key)]
    if registry.get("slot:on-device") == key:
        del registry["slot:on-device"]
    return written


def resume(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int, state_dir: str,
    _after: object = None,
) -> str:
    """Rebuild ``key``'s trainer on this worker from the state ``park`` wrote (``_after``: the park's result,
    so that Dask runs this only once the state is written)."""
    start_trainer(key, model_dir, config, temperature, max_new_tokens, version=0)
    load_state(trainer(key), Path(state_dir))
    return worker_address()


def accumulate(key: str, store_uri: str, samples_version: int, sample_ids: list[str], step: int) -> dict:
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
    store = ExperienceStore(store_uri)
    wanted = pc.field("sample_id").isin(pa.array(sample_ids))  # pushed down: skips files by their stats
    rows = store.read(store.samples_table(agent), version=samples_version, filter=wanted).sort_by("sample_id")
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
