"""Each agent's training state at its version boundaries: the cut a lost trainer or a resumed run restarts from.

Every ``run.snapshot_every`` updates the pipeline writes the agent's whole training state
(``TrainingState.to(uri)``: weights, Adam moments, scheduler, version, RNG) to ``<root>/<agent>/v<N>``, as it
was before the update is recorded in the store. Whatever version the store says an agent is at, its state of that
version is here or is rebuilt from the one before it by replaying the store's updates (``replay.py``), and a
trainer built from it on any worker continues exactly where the lost one was at the start of the step. ``root`` is a
directory or fsspec URI every worker reaches: ``<training.state_uri>/by-version`` (by default under the run
directory, like the states parked when agents move between slots; agent names cannot contain '-', so it
never clashes with an agent's parked state).

A state's JSON file is written last, so a snapshot whose write was cut short is never taken for a complete
one. Version 0 needs no snapshot: it is the agent's model directory.

The pipeline's snapshots are written in the background (``save_snapshot(..., background=True)``): the task copies
the state to host memory and returns, and the worker's writer thread writes the copy while the worker trains
and samples on. Until the write ends the snapshot is not whole, which every reader already handles: a rebuild
of its version waits on the version's lock, which the write holds, and a lost write is rebuilt by replay.

Example:
    >>> save_snapshot("run-1/solver", "runs/x/state/by-version", 3, {})          # on the trainer's worker
    >>> restore_trainer("run-2/solver", model_dir, cfg, 1.0, 24, "runs/x/state/by-version/solver/v3", 3, {})
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec
import torch
from filelock import FileLock
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_tensors

from flexmarl.cluster.worker_state import EngineKey, engines, worker_address
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import TrainerGroup
from flexmarl.training.state import DEVICE, META, WEIGHTS, HostCopy, TrainingState, state_problem

SNAPSHOTS = "by-version"  # under the run's state location
WRITES = "write"  # the registry's kind for a trainer's background write in flight: "write:<run id>/<agent>"
log = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """An agent's training state of the version the store names is missing; the message says why and what to do."""


def snapshot_uri(root: str, agent: str, version: int) -> str:
    return f"{root.rstrip('/')}/{agent}/v{version}"


def find_snapshot(root: str, agent: str, version: int, storage_options: dict | None = None) -> str | None:
    """The complete snapshot of ``agent`` at ``version``, or None."""
    uri = snapshot_uri(root, agent, version)
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    return uri if fs.exists(f"{path}/{META}") else None


def snapshot_problem(root: str, agent: str, version: int, storage_options: dict | None = None) -> str | None:
    """Why ``agent``'s snapshot of ``version`` cannot be restarted from (missing, cut short, another
    version), or None when it is whole."""
    return state_problem(snapshot_uri(root, agent, version), storage_options, version=version)


def newest_whole_snapshot(root: str, agent: str, below: int, storage_options: dict | None = None) -> int:
    """The newest version under ``below`` whose snapshot of ``agent`` is whole; 0 (the model directory) if none."""
    for version in sorted((v for v in _stored_versions(root, agent, storage_options) if 0 < v < below), reverse=True):
        if snapshot_problem(root, agent, version, storage_options) is None:
            return version
    return 0


def rebuild_lock(version: int) -> str:
    """The file, beside an agent's snapshots, that a rebuild of ``version`` holds (``replay.ensure_snapshot``)."""
    return f"rebuild-v{version}.lock"


_LOCK = re.compile(r"rebuild-v(\d+)\.lock")


def version_lock(root: str, agent: str, version: int, storage_options: dict | None = None) -> FileLock | None:
    """The lock that the write or rebuild of ``agent``'s snapshot of ``version`` holds; None on an object store
    (rebuilds of one version may overlap there: they write the same bytes).

    Any thread may release it (a background write takes it in its task and lets go in the writer thread).
    """
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    if not isinstance(fs, LocalFileSystem):
        return None
    fs.makedirs(f"{path}/{agent}", exist_ok=True)
    return FileLock(f"{path}/{agent}/{rebuild_lock(version)}", thread_local=False)


def _entries(root: str, agent: str, storage_options: dict | None) -> dict[str, str]:
    """What lies beside ``agent``'s snapshots: name -> path."""
    fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{agent}", **(storage_options or {}))
    if not fs.exists(path):
        return {}
    return {entry.rstrip("/").rsplit("/", 1)[-1]: entry for entry in fs.ls(path, detail=False)}


def _stored_versions(root: str, agent: str, storage_options: dict | None) -> list[int]:
    names = _entries(root, agent, storage_options)
    return [int(name[1:]) for name in names if name.startswith("v") and name[1:].isdigit()]


def require_snapshot(root: str | None, agent: str, version: int, storage_options: dict | None = None) -> str | None:
    """The snapshot to restart ``agent`` from at ``version``: None at version 0 (its model directory).

    Args:
        root: the run's snapshot location; None when the run writes none (``run.save_state=false``).

    Raises:
        SnapshotError: the version is past 0 and its snapshot is missing.
    """
    if version == 0:
        return None
    if root is None:
        raise SnapshotError(
            f"agent {agent!r} must restart at v{version}, but the run writes no training state "
            "(run.save_state=false): only a run still at version 0 can recover; set run.save_state=true"
        )
    uri = find_snapshot(root, agent, version, storage_options)
    if uri is None:
        raise SnapshotError(
            f"agent {agent!r} is at v{version} in the store, but {snapshot_uri(root, agent, version)} holds no "
            "complete training state: the run had run.save_state=false or the state was removed, so the "
            "agent cannot restart exactly from its last update"
        )
    return uri


def save_snapshot(key: EngineKey, root: str, version: int, storage_options: dict, background: bool = False) -> int:
    """Write the trainer ``key``'s whole state as its snapshot of ``version`` (runs on its worker); returns the
    bytes of its tensors.

    ``background``: copy the state to host memory, then return while this worker's writer thread writes the
    copy, holding the version's lock. Either way a write of ``key`` still in flight is waited for first, and
    its error, if any, is raised here: one write per trainer at a time, and none fails unseen.

    The trainer keeps its state. Raises ``RuntimeError`` when it is not at ``version``.
    """
    wait_for_write(key)
    trainer = slot.trainer(key)
    if trainer.version != version:
        raise RuntimeError(f"trainer {str(key)!r} is at v{trainer.version}, not v{version}: refusing to snapshot it")
    uri = snapshot_uri(root, trainer.agent, version)
    if not background or trainer.mesh is not None:  # a sharded trainer's ranks write their shards together
        return TrainingState.of(trainer).to(uri, storage_options=storage_options).stored_bytes
    copy = HostCopy.capture(trainer)
    lock = version_lock(root, trainer.agent, version, storage_options)
    if lock is not None:
        lock.acquire()  # before returning: a rebuild of this version asked from now on waits for the write
    registry = engines()
    pool = registry.get_or_start("snapshots:writer",
                                 lambda: ThreadPoolExecutor(1, thread_name_prefix="flexmarl-state-writer"))
    registry[f"{WRITES}:{key}"] = pool.submit(_write, copy, uri, storage_options, lock)
    return copy.nbytes


def _write(copy: HostCopy, uri: str, storage_options: dict, lock: FileLock | None) -> int:
    try:
        return copy.write(uri, storage_options)
    except Exception:
        log.exception("the background write of %s failed; the agent's next snapshot raises it", uri)
        raise
    finally:
        copy.release()
        if lock is not None:
            lock.release()


def wait_for_write(key: EngineKey) -> None:
    """Wait for the background write of trainer ``key``'s snapshot, if one is in flight here; raise its error."""
    pending: Future | None = engines().pop(f"{WRITES}:{key}", None)
    if pending is not None:
        pending.result()


def restore_trainer(
    key: EngineKey, model_dir: str, config: TrainerConfig, temperature: float, max_new_tokens: int,
    snapshot: str | None, version: int, storage_options: dict, group: TrainerGroup | None = None,
) -> str:
    """Build ``key``'s trainer afresh on this worker (replacing any it holds) from its snapshot of ``version``,
    or from ``model_dir`` at version 0. Returns the worker's address. A sharded agent's ranks of ``group`` all
    call this at once.

    A fresh trainer holds no accumulated gradient: the step it was in is trained again from its start.
    """
    agent = key.agent
    trainer = slot.build_trainer(key, model_dir, config, temperature, max_new_tokens, group=group)
    if snapshot is not None:
        TrainingState.at(agent, snapshot, storage_options=storage_options).to(DEVICE, trainer=trainer)
    if trainer.version != version:
        trainer.close()
        raise SnapshotError(f"the snapshot {snapshot} of agent {agent!r} holds v{trainer.version}, not v{version}")
    slot.install(key, trainer)  # replacing a trainer left over from before the fault
    return worker_address()


def weights_uri(snapshot: str | None) -> str | None:
    """The snapshot's weights file (safetensors), which a rollout replica loads; None for None."""
    return None if snapshot is None else f"{snapshot}/{WEIGHTS}"


def load_weights(snapshot: str, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights of a snapshot (not its optimizer state)."""
    fs, path = fsspec.core.url_to_fs(weights_uri(snapshot), **(storage_options or {}))
    return load_tensors(fs.cat_file(path))


def prune_snapshots(root: str, agent: str, keep_from: int, storage_options: dict | None = None) -> None:
    """Delete ``agent``'s snapshots of versions below ``keep_from``, and the locks of their rebuilds, once the
    snapshot of ``keep_from`` is whole (a background write may still be under way: until it ends, the older one
    is what a rebuild starts from)."""
    if keep_from > 0 and snapshot_problem(root, agent, keep_from, storage_options) is not None:
        return
    fs, _ = fsspec.core.url_to_fs(root, **(storage_options or {}))
    for name, path in _entries(root, agent, storage_options).items():
        version = int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None
        lock = _LOCK.fullmatch(name)  # nobody rebuilds a version below keep_from
        if version is not None and version < keep_from:
            fs.rm(path, recursive=True)
        elif lock is not None and int(lock.group(1)) < keep_from:
            fs.rm(path)
