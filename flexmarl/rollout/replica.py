"""Functions that run on a Dask worker to host and drive rollout replicas.

The driver submits them pinned to a worker (``workers=[address]``); they find the replica in the
worker's engine registry under ``key`` (``"<run id>/<agent>"``), so several runs can share a cluster. The replicas
of a run's adapter agents on one worker share one base model per model directory (an ``AdapterHost``, or a
vLLM engine that serves adapters, under ``adapters.host_key``).
"""

from __future__ import annotations

import fsspec
import torch
from safetensors.torch import load as load_tensors

from flexmarl.cluster.worker_state import EngineKey, engines, worker_address
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.adapters import AdapterHost, host_key
from flexmarl.rollout.adapter_backend import AdapterBackend
from flexmarl.rollout.backend import (
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    WeightsLoaded,
    WeightSyncError,
    WeightUpdate,
)
from flexmarl.rollout.config import RolloutConfig
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.rollout.vllm_adapter_backend import VLLMAdapterBackend
from flexmarl.rollout.vllm_backend import VLLMBackend
from flexmarl.training import slot
from flexmarl.training.state import tensor_bytes


def _key(key: EngineKey | str) -> str:
    return f"replica:{key}"


def open_backend(
    model_dir: str, version: int, rollout: RolloutConfig, key: EngineKey | None = None,
    adapter: AdapterConfig | None = None,
) -> GenerationBackend:
    """The backend ``rollout.backend`` names, loaded and ready to generate; for an adapter agent, its adapter
    on this worker's shared base (``key``: the replica's)."""
    if adapter is not None and rollout.backend == "vllm":
        engine = engines().get_or_start(
            _key(host_key(key, model_dir)),
            lambda: VLLMBackend(model_dir, settings=rollout.vllm, adapters=True).start())
        return VLLMAdapterBackend(engine, str(key), adapter, version=version)
    if adapter is not None:
        host = engines().get_or_start(_key(host_key(key, model_dir)),
                                      lambda: AdapterHost(model_dir, HFBackend.default_device()))
        return AdapterBackend(host, key.agent, adapter, version=version, decode=rollout.decode)
    if rollout.backend == "vllm":
        return VLLMBackend(model_dir, version=version, settings=rollout.vllm).start()
    return HFBackend(model_dir, version=version, decode=rollout.decode)


def start_replica(
    key: EngineKey, model_dir: str, version: int, rollout: RolloutConfig | None = None,
    adapter: AdapterConfig | None = None,
) -> str:
    """Load the model on this worker (once), with the backend of ``rollout`` (default: hf); returns the address."""
    registry = engines()
    if _key(key) not in registry:
        registry[_key(key)] = open_backend(model_dir, version, rollout or RolloutConfig(), key, adapter)
    return worker_address()


def replica(key: EngineKey) -> GenerationBackend:
    return engines().lookup(
        _key(key), f"no rollout replica {str(key)!r} on worker {worker_address()}: it was never started or the worker "
        "restarted")


def generate(key: EngineKey, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return replica(key).generate(requests)


def load_weights(key: EngineKey, version: int, state: dict[str, torch.Tensor]) -> WeightsLoaded:
    """Apply a version-tagged weight update."""
    backend = replica(key)
    if version <= backend.version:
        return WeightsLoaded(backend.version, 0)  # a re-run of an update already applied: nothing to do
    try:
        backend.update_weights(WeightUpdate(str(key), version, state))
    except WeightSyncError as exc:
        raise WeightSyncError(f"replica on {worker_address()}: {exc}") from None
    return WeightsLoaded(backend.version, tensor_bytes(state))


def load_trainer_weights(key: EngineKey, version: int) -> WeightsLoaded:
    """``load_weights`` straight from ``key``'s trainer on this worker, its tensors where they are
    (``slot.weights_in_place``): the backend copies them into its own weights, device to device on a GPU, with no
    copy through host memory and no fetch."""
    if version <= replica(key).version:
        return WeightsLoaded(replica(key).version, 0)
    return load_weights(key, version, slot.weights_in_place(key, version))


def read_weights(uri: str, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    """Weights from a safetensors file at a path or fsspec URI (a training-state snapshot's weights file)."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    return load_tensors(fs.cat_file(path))


def restart_replica(
    key: EngineKey, model_dir: str, version: int, rollout: RolloutConfig, weights_uri: str | None,
    storage_options: dict,
    adapter: AdapterConfig | None = None,
) -> str:
    """Build ``key``'s replica afresh on this worker (replacing any) at ``version``: the weights of
    ``weights_uri`` (a training-state snapshot's), or of ``model_dir`` at version 0. Returns the address."""
    backend = open_backend(model_dir, 0, rollout, key, adapter)
    if weights_uri is not None:
        backend.update_weights(WeightUpdate(str(key), version, read_weights(weights_uri, storage_options)))
    engines().replace(_key(key), backend)
    return worker_address()


def load_weights_from(key: EngineKey, version: int, weights_uri: str, storage_options: dict) -> WeightsLoaded:
    """``load_weights`` from a training-state snapshot that every worker reaches, not from a trainer's memory."""
    if version <= replica(key).version:
        return WeightsLoaded(replica(key).version, 0)
    return load_weights(key, version, read_weights(weights_uri, storage_options))
