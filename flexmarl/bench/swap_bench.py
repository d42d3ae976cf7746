"""`flexmarl bench swap`: how fast an agent's whole training state moves, and whether it comes back exact.

For each model: build a trainer, take one optimizer step (so the Adam moments exist), then time
device -> host, host -> device, host -> disk and disk -> a fresh trainer, and compare every tensor bit by bit.
Without a GPU, "device" and "host" are the same memory and the first two figures are plain copies.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flexmarl.models.loading import resolve_model
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import load_state, move, save_state
from flexmarl.training.trainer import AgentTrainer, TrainBatch


def _snapshot(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    for i, per_param in trainer.optimizer.state.items():
        for name, value in per_param.items():
            out[f"o.{i}.{name}"] = value.detach().cpu().clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def _state_bytes(snapshot: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in snapshot.values())


def _timed(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_one(model: str) -> dict:
    model_dir = resolve_model(model)
    trainer = AgentTrainer("bench", model_dir, TrainerConfig(lr=1e-5), temperature=1.0)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 24), generator=g).tolist()
    trainer.train_step(TrainBatch(["a", "b"], [i[:16] for i in ids], [i[16:] for i in ids],
                                  [[-1.0] * 8] * 2, [1.0, -1.0], [0, 0]))
    before = _snapshot(trainer)
    result = {"state_bytes": _state_bytes(before)}
    result["to_host_s"] = _timed(lambda: move(trainer, "host"))
    result["to_device_s"] = _timed(lambda: move(trainer, "device"))
    with tempfile.TemporaryDirectory() as tmp:
        result["to_disk_s"] = _timed(lambda: save_state(trainer, Path(tmp)))
        fresh = AgentTrainer("bench", model_dir, TrainerConfig(lr=1e-5), temperature=1.0)
        result["from_disk_s"] = _timed(lambda: load_state(fresh, Path(tmp)))
    after_moves, restored = _snapshot(trainer), _snapshot(fresh)
    result["bit_exact"] = all(torch.equal(before[k], after_moves[k]) and torch.equal(before[k], restored[k])
                              for k in before)
    for leg in ("to_host", "to_device", "to_disk", "from_disk"):
        result[f"{leg}_gb_per_s"] = result["state_bytes"] / result[f"{leg}_s"] / 1e9
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return result


def bench_swap(models: Sequence[str], log: Callable[[str], None] = print) -> dict:
    report = {"models": {}}
    for model in models:
        log(f"swap benchmark: {model}")
        report["models"][model] = bench_one(model)
    report["bit_exact"] = all(m["bit_exact"] for m in report["models"].values())
    report["device"] = next(iter(report["models"].values()))["device"] if report["models"] else "cpu"
    return report
