"""Functions that run on a Dask worker to host and drive one agent's rollout replica.

The driver submits them pinned to the replica's worker (``workers=[address]``); they find the replica in
the worker's engine registry.
"""

from __future__ import annotations

import torch

from flexmarl.cluster.worker_state import engines, worker_address
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightSyncError, WeightUpdate
from flexmarl.rollout.hf_backend import HFBackend


def _key(agent: str) -> str:
    return f"replica:{agent}"


def start_replica(agent: str, model_dir: str, version: int) -> str:
    """Load the agent's model on this worker (once) and return the worker's address."""
    registry = engines()
    if _key(agent) not in registry:
        registry[_key(agent)] = HFBackend(model_dir, version=version)
    return worker_address()


def replica(agent: str) -> HFBackend:
    try:
        return engines()[_key(agent)]
    except KeyError:
        raise RuntimeError(
            f"no rollout replica of agent {agent!r} on worker {worker_address()}: it was never started "
            "or the worker restarted"
        ) from None


def generate(agent: str, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return replica(agent).generate(requests)


def load_weights(agent: str, version: int, state: dict[str, torch.Tensor]) -> int:
    """Apply a version-tagged weight update; returns the replica's version afterwards."""
    backend = replica(agent)
    if version <= backend.version:
        return backend.version  # a re-run of an update already applied: nothing to do
    try:
        backend.update_weights(WeightUpdate(agent, version, state))
    except WeightSyncError as exc:
        raise WeightSyncError(f"replica on {worker_address()}: {exc}") from None
    return backend.version
