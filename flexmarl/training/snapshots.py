"""Each agent's training state at its version boundaries: the cut a lost trainer or a resumed run restarts from.

After every update the pipeline writes the agent's whole training state (``state.save_state``: weights, Adam
moments, version, RNG) to ``<root>/<agent>/v<N>``, before the update is recorded in the store. So whatever
version the store says an agent is at, its state of that version is here, and a trainer rebuilt from it on
any worker continues exactly where the lost one was at the start of the step. ``root`` must be a directory
every worker can read and write (``RUN_DIR/training_state``: the run directory is shared already).

A snapshot is written to a hidden temporary directory and renamed, so a crash never leaves a half-written
state under a version's name. Version 0 needs no snapshot: it is the agent's model directory.

Example:
    >>> save_snapshot("run-1/solver", "runs/x/training_state", 3)          # on the trainer's worker
    >>> restore_trainer("run-2/solver", model_dir, cfg, 1.0, 24, "runs/x/training_state/solver/v3", 3)
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file

from flexmarl.cluster.worker_state import engines, worker_address
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import META, WEIGHTS, load_state, save_state
from flexmarl.training.trainer import AgentTrainer

SNAPSHOTS = "training_state"  # the directory under a run directory


class SnapshotError(RuntimeError):
    """An agent's training state of the version the store names is missing; the message says why and what to do."""


def snapshot_dir(root: str | Path, agent: str, version: int) -> Path:
    return Path(root) / agent / f"v{version}"


def find_snapshot(root: str | Path, agent: str, version: int) -> Path | None:
    """The complete snapshot of ``agent`` at ``version``, or None (version 0 is the model directory)."""
    path = snapshot_dir(root, agent, version)
    return path if (path / META).exists() else None


def require_snapshot(root: str | Path | None, agent: str, version: int) -> Path | None:
    """The snapshot to restart ``agent`` from at ``version``: None at version 0 (its model directory).

    Args:
        root: the run's snapshot directory; None when the run writes none (``train.save_state=false``).

    Raises:
        SnapshotError: the version is past 0 and its snapshot is missing.
    """
    if version == 0:
        return None
    if root is None:
        raise SnapshotError(
            f"agent {agent!r} must restart at v{version}, but the run writes no training state "
            "(train.save_state=false): only a run still at version 0 can recover; set train.save_state=true"
        )
    path = find_snapshot(root, agent, version)
    if path is None:
        raise SnapshotError(
            f"agent {agent!r} is at v{version} in the store, but {snapshot_dir(root, agent, version)} holds no "
            "training state: the run had train.save_state=false or the directory was removed, so the agent "
            "cannot restart exactly from its last update"
        )
    return path


def weights_file(snapshot: Path | None) -> str | None:
    return None if snapshot is None else str(snapshot / WEIGHTS)


def save_snapshot(key: str, root: str, version: int) -> int:
    """Write the trainer ``key``'s whole state as its snapshot of ``version`` (runs on its worker); returns bytes.

    Raises:
        RuntimeError: the trainer is not at ``version`` (the update it follows was not applied here).
    """
    trainer = slot.trainer(key)
    if trainer.version != version:
        raise RuntimeError(f"trainer {key!r} is at v{trainer.version}, not v{version}: refusing to snapshot it")
    final = snapshot_dir(root, trainer.agent, version)
    tmp = final.with_name(f".{final.name}-{uuid.uuid4().hex[:8]}")
    written = save_state(trainer, tmp)
    if final.exists():  # the same update taken again after a fault: the new copy is identical
        shutil.rmtree(final)
    tmp.rename(final)
    return written


def restore_trainer(
    key: str, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int,
    snapshot: str | None, version: int,
) -> str:
    """Build ``key``'s trainer afresh on this worker (replacing any it holds) from its snapshot of ``version``,
    or from ``model_dir`` at version 0. Returns the worker's address.

    A fresh trainer holds no accumulated gradient: the step it was in is trained again from its start.
    """
    agent = key.rsplit("/", 1)[-1]
    trainer = AgentTrainer(agent, model_dir, config, temperature=temperature, max_new_tokens=max_new_tokens)
    if snapshot is not None:
        load_state(trainer, Path(snapshot))
    if trainer.version != version:
        raise SnapshotError(f"the snapshot {snapshot} of agent {agent!r} holds v{trainer.version}, not v{version}")
    engines()[slot._key(key)] = trainer  # replaces a trainer left over from before the fault
    return worker_address()


def load_weights(snapshot: str) -> dict[str, torch.Tensor]:
    return load_file(Path(snapshot) / WEIGHTS)


def prune_snapshots(root: str | Path, agent: str, keep_from: int) -> None:
    """Delete ``agent``'s snapshots of versions below ``keep_from``, and temporary directories of older ones."""
    directory = Path(root) / agent
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        name = path.name.lstrip(".").split("-")[0]
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep_from:
            shutil.rmtree(path, ignore_errors=True)
