"""An agent's whole training state (weights, optimizer state, version, RNG) and moving it between places.

One API moves the state of any trainer between the accelerator (``"device"``), host memory (``"host"``),
and a directory on disk or a shared file system (a path). Any training slot on any worker can then resume
any agent. Everything is written as safetensors plus JSON, never pickle, and a round trip is bit-exact.

Example:
    >>> bytes_written = save_state(trainer, Path("runs/x/state/solver"))
    >>> load_state(other_trainer, Path("runs/x/state/solver"))   # same weights, moments, step, RNG
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.safetensors"
META = "state.json"


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """(weights, optimizer tensors, JSON metadata) of a trainer's model and optimizer."""
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, per_param in opt["state"].items():
        for name, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value
            else:
                scalars[f"{index}.{name}"] = value
    meta = {"param_groups": opt["param_groups"], "scalars": scalars}
    return weights, tensors, meta


def save_state(trainer, directory: Path) -> int:
    """Write the trainer's whole state to ``directory``; returns the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights, tensors, meta = state_tensors(model, trainer.optimizer)
    # safetensors refuses tensors that share memory (tied embeddings): store each name's own copy
    save_file({k: v.contiguous().clone().cpu() for k, v in weights.items()}, directory / WEIGHTS)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, directory / OPTIMIZER)
    meta.update({"agent": trainer.agent, "version": trainer.version, "rng": torch.get_rng_state().tolist()})
    (directory / META).write_text(json.dumps(meta))
    return sum((directory / f).stat().st_size for f in (WEIGHTS, OPTIMIZER, META))


def load_state(trainer, directory: Path) -> None:
    """Restore a state written by ``save_state`` into a trainer built from the same model."""
    meta = json.loads((directory / META).read_text())
    if meta["agent"] != trainer.agent:
        raise ValueError(f"state in {directory} belongs to agent {meta['agent']!r}, not {trainer.agent!r}")
    device = trainer.accelerator.device
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.load_state_dict({k: v.to(device) for k, v in load_file(directory / WEIGHTS).items()})
    state: dict[int, dict] = {}
    for key, value in load_file(directory / OPTIMIZER).items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value.to(device)
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    trainer.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    trainer.version = meta["version"]
    torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))


def move(trainer, location: str) -> None:
    """Move the weights and optimizer state to ``"device"`` (the accelerator) or ``"host"`` memory.

    On a GPU, host copies go through pinned buffers (about 55 GB/s on an H200 against 7-16 through pageable
    memory). On a CPU-only machine both places are host memory and the move is a copy.
    """
    device = trainer.accelerator.device if location == "device" else torch.device("cpu")
    pin = location == "host" and torch.cuda.is_available()
    model = trainer.accelerator.unwrap_model(trainer.model)
    for p in model.parameters():
        p.data = _to(p.data, device, pin)
    for per_param in trainer.optimizer.state.values():
        for name, value in per_param.items():
            if torch.is_tensor(value) and value.dim() > 0:
                per_param[name] = _to(value, device, pin)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies must land before anyone reads them


def _to(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if pin:
        buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buffer.copy_(t, non_blocking=True)
        return buffer
    return t.to(device, copy=True)
