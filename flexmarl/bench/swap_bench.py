"""`flexmarl bench swap`: how fast an agent's whole training state moves, and whether it comes back exact.

For each model: build a trainer (with an lr warm-up, so that a scheduler state exists too), take one
optimizer step (so that the Adam moments exist), then time each leg through the one location API,
``TrainingState.to``: device -> host, host -> device, device -> a directory, the directory -> a fresh trainer,
and the same through an fsspec object store (``memory://`` by default: serialisation and copies without a
network). Every tensor, the version, the scheduler and the RNG state are then compared bit by bit.

On a CUDA machine host copies go through pinned buffers, and ``to_host_pageable_s`` adds the same copy
through pageable memory for comparison. Without a GPU, "device" and "host" are the same memory and the first
two figures are plain copies. Each model is measured twice: an agent that trains the whole model, and one that
trains a LoRA adapter on it (only the adapter's tensors and their Adam moments move).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence

import fsspec
import torch

from flexmarl.bench.timing import timed
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.loading import resolve_model
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import DEVICE, HOST, HostCopy, TrainingState
from flexmarl.training.trainer import AgentTrainer, TrainBatch

LEGS = ("to_host", "to_device", "to_disk", "from_disk", "to_object_store", "from_object_store")


def _pageable_copy(trainer: AgentTrainer) -> list[torch.Tensor]:
    tensors = [p.data for p in trainer.model.parameters()]
    tensors += [t for per_param in trainer.optimizer.state.values() for t in per_param.values()
                if torch.is_tensor(t) and t.dim() > 0]
    return [t.to("cpu") for t in tensors]


def same_state(a: HostCopy, b: HostCopy) -> bool:
    """Bit-exact equality of two captured states: every tensor, the version, scheduler and RNG."""
    return (
        a.weights.keys() == b.weights.keys() and a.optimizer.keys() == b.optimizer.keys()
        and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
        and all(torch.equal(a.optimizer[k], b.optimizer[k]) for k in a.optimizer)
        and a.meta == b.meta
    )


def bench_one(model: str, object_store: str = "memory://flexmarl-bench-swap",
              adapter: AdapterConfig | None = None) -> dict:
    """One model's legs; with ``adapter``, the state of an agent that trains that LoRA adapter on the model."""
    model_dir = resolve_model(model)
    config = TrainerConfig(lr=1e-5, lr_warmup_steps=2, adapter=adapter)

    def new_trainer() -> AgentTrainer:
        return AgentTrainer("bench", model_dir, config, temperature=1.0)

    trainer = new_trainer()
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 24), generator=g).tolist()
    trainer.train_step(TrainBatch(["a", "b"], [i[:16] for i in ids], [i[16:] for i in ids],
                                  [[-1.0] * 8] * 2, [1.0, -1.0], [0, 0]))
    before = HostCopy.capture(trainer)
    result: dict = {"state_bytes": before.nbytes}
    if torch.cuda.is_available():  # the device -> host copy without pinned buffers, for comparison
        result["to_host_pageable_s"] = timed(lambda: _pageable_copy(trainer))
        result["to_host_pageable_gb_per_s"] = result["state_bytes"] / result["to_host_pageable_s"] / 1e9
    state = TrainingState.of(trainer)
    result["to_host_s"] = timed(lambda: state.to(HOST))
    result["to_device_s"] = timed(lambda: state.to(DEVICE))
    after_moves = HostCopy.capture(trainer)
    with tempfile.TemporaryDirectory() as tmp:
        result["to_disk_s"] = timed(lambda: state.to(tmp))
        from_disk = new_trainer()
        result["from_disk_s"] = timed(lambda: state.to(DEVICE, trainer=from_disk))
    restored_disk = HostCopy.capture(from_disk)
    result["to_object_store_s"] = timed(lambda: state.to(object_store))
    from_store = new_trainer()
    result["from_object_store_s"] = timed(lambda: state.to(DEVICE, trainer=from_store))
    restored_store = HostCopy.capture(from_store)
    fs, root = fsspec.core.url_to_fs(object_store)
    fs.rm(root, recursive=True)
    result["bit_exact"] = all(same_state(before, x) for x in (after_moves, restored_disk, restored_store))
    for leg in LEGS:
        result[f"{leg}_gb_per_s"] = result["state_bytes"] / result[f"{leg}_s"] / 1e9
    result["object_store"] = object_store.split("://", 1)[0] if "://" in object_store else "file"
    result["pinned"] = torch.cuda.is_available()  # host copies through pinned buffers
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return result


def bench_swap(models: Sequence[str], log: Callable[[str], None] = print, adapter_rank: int = 8) -> dict:
    """Each model's full training state (``models``) and, unless ``adapter_rank`` is 0, the state of a LoRA
    adapter agent of that rank on it (``adapters``): what a slot moves for each kind of agent."""
    report: dict = {"models": {}, "adapters": {}}
    for model in models:
        log(f"swap benchmark: {model}")
        report["models"][model] = bench_one(model)
        if adapter_rank:
            log(f"swap benchmark: {model}, LoRA adapter r={adapter_rank}")
            adapter = AdapterConfig(r=adapter_rank, alpha=2 * adapter_rank)
            report["adapters"][model] = {"r": adapter_rank, **bench_one(model, adapter=adapter)}
    report["bit_exact"] = all(m["bit_exact"] for kind in ("models", "adapters") for m in report[kind].values())
    report["device"] = next(iter(report["models"].values()))["device"] if report["models"] else "cpu"
    return report
