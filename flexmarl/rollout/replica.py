"""Functions that run on a Dask worker to host and drive rollout replicas.

The driver submits them pinned to a worker (``workers=[address]``); they find the replica in the
worker's engine registry under ``key`` (``"<run id>/<agent>"``), so several runs can share a cluster.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from flexmarl.cluster.worker_state import engines, worker_address
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightSyncError, WeightUpdate
from flexmarl.rollout.hf_backend import HFBackend


def _key(key: str) -> str:
    return f"replica:{key}"


def start_replica(key: str, model_dir: str, version: int) -> str:
    """Load the model on this worker (once) and return the worker's address."""
    registry = engines()
    if _key(key) not in registry:
        registry[_key(key)] = HFBackend(model_dir, version=version)
    return worker_address()


def replica(key: str) -> HFBackend:
    try:
        return engines()[_key(key)]
    except KeyError:
        raise RuntimeError(
            f"no rollout replica {key!r} on worker {worker_address()}: it was never started or the worker restarted"
        ) from None


def generate(key: str, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return replica(key).generate(requests)


def load_weights(key: str, version: int, state: dict[str, torch.Tensor]) -> int:
    """Apply a version-tagged weight update; returns the replica's version afterwards."""
    backend = replica(key)
    if version <= backend.version:
        return backend.version  # a re-run of an update already applied: nothing to do
    try:
        backend.update_weights(WeightUpdate(key, version, state))
    except WeightSyncError as exc:
        raise WeightSyncError(f"replica on {worker_address()}: {exc}") from None
    return backend.version


def restart_replica(key: str, model_dir: str, version: int, weights_file: str | None) -> str:
    """Build ``key``'s replica afresh on this worker (replacing any) at ``version``: the weights of
    ``weights_file`` (a training-state snapshot), or of ``model_dir`` at version 0. Returns the worker's address.
    """
    backend = HFBackend(model_dir, version=0)
    if weights_file is not None:
        backend.update_weights(WeightUpdate(key, version, load_file(weights_file)))
    engines()[_key(key)] = backend
    return worker_address()


def load_weights_file(key: str, version: int, weights_file: str) -> int:
    """``load_weights`` from a training-state snapshot on a shared file system, not from a trainer's memory."""
    if version <= replica(key).version:
        return replica(key).version
    return load_weights(key, version, load_file(weights_file))
