"""Training-state snapshots at version boundaries: written, restored exactly, pruned, required."""

from __future__ import annotations

import pytest
import torch

from flexmarl.cluster.worker_state import engines
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.snapshots import (
    SnapshotError,
    find_snapshot,
    load_weights,
    prune_snapshots,
    require_snapshot,
    restore_trainer,
    save_snapshot,
    snapshot_uri,
)

from .test_trainer import make_batch


def test_a_trainer_restored_from_its_snapshot_continues_identically(tiny_dir, tmp_path) -> None:
    cfg = TrainerConfig(lr=1e-3)
    root = str(tmp_path / "by-version")
    slot.start_trainer("run-a/solver", str(tiny_dir), cfg, 1.0, 8, 0)  # outside Dask: the process's registry
    original = slot.trainer("run-a/solver")
    original.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5]))
    with pytest.raises(RuntimeError, match="is at v1, not v2: refusing"):
        save_snapshot("run-a/solver", root, 2, {})
    save_snapshot("run-a/solver", root, 1, {})
    assert find_snapshot(root, "solver", 1) == snapshot_uri(root, "solver", 1)
    assert all(torch.equal(load_weights(snapshot_uri(root, "solver", 1))[k], v)
               for k, v in original.weights().items())

    snap = require_snapshot(root, "solver", 1)
    restore_trainer("run-b/solver", str(tiny_dir), cfg, 1.0, 8, snap, 1, {})
    restored = slot.trainer("run-b/solver")
    assert restored.version == 1
    batch = make_batch(tiny_dir, [0.5, -0.5, 1.0])
    original.train_step(batch)
    restored.train_step(batch)  # weights, Adam moments and step count came back: the next step is the same
    assert all(torch.equal(a, b) for a, b in zip(original.weights().values(), restored.weights().values()))
    with pytest.raises(SnapshotError, match="holds v1, not v2"):
        restore_trainer("run-c/solver", str(tiny_dir), cfg, 1.0, 8, snap, 2, {})
    for key in ("trainer:run-a/solver", "trainer:run-b/solver"):
        engines().pop(key).close()


def test_snapshots_are_required_past_version_zero_and_pruned(tmp_path) -> None:
    root = str(tmp_path)
    assert require_snapshot(root, "solver", 0) is None  # version 0 is the model directory
    assert require_snapshot(None, "solver", 0) is None
    with pytest.raises(SnapshotError, match=r"solver/v3 holds no complete training state"):
        require_snapshot(root, "solver", 3)
    with pytest.raises(SnapshotError, match="train.save_state=false.*set train.save_state=true"):
        require_snapshot(None, "solver", 3)
    for name in ("v1", "v2", "v3", "v10"):
        (tmp_path / "solver" / name).mkdir(parents=True)
    prune_snapshots(root, "solver", keep_from=3)
    assert sorted(p.name for p in (tmp_path / "solver").iterdir()) == ["v10", "v3"]
