"""Training-state snapshots at version boundaries: written (in the foreground or the background), restored
exactly, pruned, required."""

from __future__ import annotations

import threading

import pytest
import torch

from flexmarl.cluster.worker_state import EngineKey, engines, release
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.replay import StateSource, ensure_snapshot
from flexmarl.training.snapshots import (
    SnapshotError,
    find_snapshot,
    load_weights,
    newest_whole_snapshot,
    prune_snapshots,
    require_snapshot,
    restore_trainer,
    save_snapshot,
    snapshot_problem,
    snapshot_uri,
    wait_for_write,
)
from flexmarl.training.state import META, OPTIMIZER, WEIGHTS, HostCopy

from .test_trainer import make_batch


@pytest.mark.parametrize("adapter", [None, AdapterConfig(r=4, alpha=8)], ids=["full-model", "lora-adapter"])
def test_a_trainer_restored_from_its_snapshot_continues_identically(tiny_dir, tmp_path, adapter) -> None:
    cfg = TrainerConfig(lr=1e-3, adapter=adapter)
    root = str(tmp_path / "by-version")
    # outside Dask: the process's registry
    slot.start_trainer(EngineKey("run-a", "solver"), str(tiny_dir), cfg, 1.0, 8, 0)
    original = slot.trainer(EngineKey("run-a", "solver"))
    original.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5]))
    with pytest.raises(RuntimeError, match="is at v1, not v2: refusing"):
        save_snapshot(EngineKey("run-a", "solver"), root, 2, {})
    save_snapshot(EngineKey("run-a", "solver"), root, 1, {})
    assert find_snapshot(root, "solver", 1) == snapshot_uri(root, "solver", 1)
    assert all(torch.equal(load_weights(snapshot_uri(root, "solver", 1))[k], v)
               for k, v in original.weights().items())

    snap = require_snapshot(root, "solver", 1)
    restore_trainer(EngineKey("run-b", "solver"), str(tiny_dir), cfg, 1.0, 8, snap, 1, {})
    restored = slot.trainer(EngineKey("run-b", "solver"))
    assert restored.version == 1
    batch = make_batch(tiny_dir, [0.5, -0.5, 1.0])
    original.train_step(batch)
    restored.train_step(batch)  # weights, Adam moments and step count came back: the next step is the same
    assert all(torch.equal(a, b) for a, b in zip(original.weights().values(), restored.weights().values()))
    with pytest.raises(SnapshotError, match="holds v1, not v2"):
        restore_trainer(EngineKey("run-c", "solver"), str(tiny_dir), cfg, 1.0, 8, snap, 2, {})
    assert (adapter is None) == all("lora_" not in k for k in restored.weights())  # an adapter's: its tensors only
    for run in ("run-a", "run-b"):
        release(f"trainer:{run}/")  # the trainers, and an adapter agent's shared base


def test_snapshots_are_required_past_version_zero_and_pruned(tiny_dir, tmp_path) -> None:
    root = str(tmp_path)
    assert require_snapshot(root, "solver", 0) is None  # version 0 is the model directory
    assert require_snapshot(None, "solver", 0) is None
    with pytest.raises(SnapshotError, match=r"solver/v3 holds no complete training state"):
        require_snapshot(root, "solver", 3)
    with pytest.raises(SnapshotError, match="run.save_state=false.*set run.save_state=true"):
        require_snapshot(None, "solver", 3)
    for name in ("v1", "v2", "v10"):
        (tmp_path / "solver" / name).mkdir(parents=True)
    for lock in ("rebuild-v2.lock", "rebuild-v3.lock"):  # left by replay.ensure_snapshot
        (tmp_path / "solver" / lock).touch()
    everything = sorted(p.name for p in (tmp_path / "solver").iterdir())
    prune_snapshots(root, "solver", keep_from=3)  # v3 is not whole yet (its write may be under way): keep v2
    assert sorted(p.name for p in (tmp_path / "solver").iterdir()) == everything
    slot.start_trainer(EngineKey("run-p", "solver"), str(tiny_dir), TrainerConfig(lr=1e-3), 1.0, 8, 0)
    for _ in range(3):
        slot.trainer(EngineKey("run-p", "solver")).train_step(make_batch(tiny_dir, [1.0, -1.0]))
    save_snapshot(EngineKey("run-p", "solver"), root, 3, {})
    prune_snapshots(root, "solver", keep_from=3)
    assert sorted(p.name for p in (tmp_path / "solver").iterdir()) == ["rebuild-v3.lock", "v10", "v3"]
    release("trainer:run-p/")


def test_a_background_write_holds_the_state_of_its_version_and_rebuilds_wait_for_it(tiny_dir, tmp_path,
                                                                                     monkeypatch) -> None:
    root, go = str(tmp_path / "by-version"), threading.Event()
    write = HostCopy.write

    def held_write(self, uri, storage_options=None):  # noqa: ANN001, ANN202 - the write starts when the test says
        assert go.wait(30)
        return write(self, uri, storage_options)

    monkeypatch.setattr(HostCopy, "write", held_write)
    cfg = TrainerConfig(lr=1e-3)
    slot.start_trainer(EngineKey("run-w", "solver"), str(tiny_dir), cfg, 1.0, 8, 0)
    trainer = slot.trainer(EngineKey("run-w", "solver"))
    trainer.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5]))
    at_v1 = {k: v.clone() for k, v in trainer.weights().items()}
    # it returns with the write held back
    assert save_snapshot(EngineKey("run-w", "solver"), root, 1, {}, background=True) > 0
    assert find_snapshot(root, "solver", 1) is None  # not whole while it is written
    trainer.train_step(make_batch(tiny_dir, [0.5, -0.5]))  # the trainer goes on to v2 meanwhile

    # a worker that needs v1 now (a lost replica's restart) waits for the write instead of replaying the store
    source = StateSource(EngineKey("run-w", "solver"), str(tiny_dir), cfg, 1.0, 8, root, 1, None, {})
    found: list[str] = []
    waiter = threading.Thread(target=lambda: found.append(ensure_snapshot(source)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not found
    go.set()
    waiter.join(30)
    assert found == [snapshot_uri(root, "solver", 1)]
    written = load_weights(found[0])  # v1's weights, not the v2 the trainer holds now
    assert all(torch.equal(written[k], v) for k, v in at_v1.items())
    assert not all(torch.equal(written[k], v) for k, v in trainer.weights().items())
    release("trainer:run-w/")


def test_a_failed_background_write_is_raised_by_the_next_snapshot(tiny_dir, tmp_path, monkeypatch) -> None:
    root = str(tmp_path / "by-version")

    def full_disk(self, uri, storage_options=None):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device")

    slot.start_trainer(EngineKey("run-f", "solver"), str(tiny_dir), TrainerConfig(lr=1e-3), 1.0, 8, 0)
    slot.trainer(EngineKey("run-f", "solver")).train_step(make_batch(tiny_dir, [1.0, -1.0]))
    with monkeypatch.context() as patch:
        patch.setattr(HostCopy, "write", full_disk)
        save_snapshot(EngineKey("run-f", "solver"), root, 1, {}, background=True)
        with pytest.raises(OSError, match="No space left"):
            save_snapshot(EngineKey("run-f", "solver"), root, 1, {})
    assert find_snapshot(root, "solver", 1) is None
    # the lock of v1 was let go: a new write goes
    save_snapshot(EngineKey("run-f", "solver"), root, 1, {}, background=True)
    wait_for_write(EngineKey("run-f", "solver"))
    assert find_snapshot(root, "solver", 1) is not None
    release("trainer:run-f/")


def test_a_damaged_snapshot_is_told_from_a_whole_one(tiny_dir, tmp_path) -> None:
    root = str(tmp_path / "by-version")
    slot.start_trainer(EngineKey("run-d", "solver"), str(tiny_dir), TrainerConfig(lr=1e-3), 1.0, 8, 0)
    trainer = slot.trainer(EngineKey("run-d", "solver"))
    for version in (1, 2, 3, 4):
        trainer.train_step(make_batch(tiny_dir, [1.0, -1.0]))
        save_snapshot(EngineKey("run-d", "solver"), root, version, {})
    engines().pop("trainer:run-d/solver").close()
    assert snapshot_problem(root, "solver", 4) is None
    v4, v3, v2 = (tmp_path / "by-version" / "solver" / f"v{v}" for v in (4, 3, 2))
    weights = (v4 / WEIGHTS).read_bytes()
    (v4 / WEIGHTS).write_bytes(weights[: len(weights) // 2])  # cut short
    assert "damaged weights.safetensors" in snapshot_problem(root, "solver", 4)
    (v4 / WEIGHTS).write_bytes(weights + b"x")
    assert "bytes where its header needs" in snapshot_problem(root, "solver", 4)
    (v4 / WEIGHTS).write_bytes(b"\xff" * 64)  # garbage header
    assert "damaged weights.safetensors" in snapshot_problem(root, "solver", 4)
    (v3 / META).write_text("{not json")
    assert "does not parse" in snapshot_problem(root, "solver", 3)
    (v2 / OPTIMIZER).unlink()
    assert "damaged optimizer.safetensors: missing" in snapshot_problem(root, "solver", 2)
    assert "has no state.json" in snapshot_problem(root, "solver", 7)
    (v3 / META).write_text((v4 / META).read_text())  # a whole file, but of another version
    assert snapshot_problem(root, "solver", 3) == "holds v4"
    # the newest whole snapshot under v4 is v1; under v1 there is only the model directory
    assert newest_whole_snapshot(root, "solver", below=4) == 1
    assert newest_whole_snapshot(root, "solver", below=1) == 0


def test_one_worker_never_rebuilds_a_sharded_state(tiny_dir, tmp_path) -> None:
    """A sharded state may not fit one worker, and only its ranks together replay it (``replay.rebuild_trainer``):
    asked for a version the run did not write, one worker refuses in one line, rebuilding nothing."""
    root = str(tmp_path / "by-version")
    cfg = TrainerConfig(lr=1e-3, sharding="full", max_slots=2)
    source = StateSource(EngineKey("run-w", "solver"), str(tiny_dir), cfg, 1.0, 8, root, 3, None, {})
    with pytest.raises(SnapshotError, match=r"sharded agent 'solver' at v3 has no state.json .* rebuilt only by "
                                            r"its ranks together"):
        ensure_snapshot(source)
    assert not [k for k in engines() if "~replay" in k] and find_snapshot(root, "solver", 3) is None
