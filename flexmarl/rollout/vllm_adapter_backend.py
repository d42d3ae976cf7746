"""A rollout replica of an adapter agent on vLLM: its LoRA adapter in an engine it shares with other agents.

A worker runs one vLLM engine per base model (``enable_lora``) for all of the run's adapter agents of that
model, as the HF backend shares one transformers base (``adapter_backend.py``). Each agent's requests carry
its adapter (a ``LoRARequest``), so the engine can sample a batch for any of them without loading weights.

A weight update writes the adapter's tensors to a version-tagged directory (``<agent>/v<N>``, peft's format)
and loads it under a new adapter id, then drops the previous version: vLLM caches adapters by id, so a new
version must not reuse the old one's. At version 0 an agent's adapter is LoRA's start (B = 0), which leaves
the base unchanged, so its requests go to the base until its first update.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import tempfile
from pathlib import Path

from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.adapters import adapter_reference, lora_config, write_adapter
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightUpdate, check_update
from flexmarl.rollout.vllm_backend import VLLMBackend

_IDS = itertools.count(1)  # vLLM adapter ids: unique in the process, so no two versions (or agents) share one


class VLLMAdapterBackend:
    """Replica ``key`` (``"<run id>/<agent>"``) of an adapter agent on ``engine``, a started ``VLLMBackend``
    with ``adapters=True`` that other adapter agents of the same base share."""

    def __init__(self, engine: VLLMBackend, key: str, adapter: AdapterConfig, *, version: int = 0) -> None:
        self.engine, self.key, self.adapter = engine, key, adapter
        self.version = version
        self._reference = adapter_reference(engine.model_dir, adapter)  # what an update must match
        self._dir = Path(tempfile.mkdtemp(prefix="flexmarl-lora-"))
        self._lora = None  # the engine's LoRARequest of the current version; None: the base (version 0)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = self.engine.generate(requests, lora=self._lora)
        return [dataclasses.replace(r, policy_version=self.version) for r in results]

    def update_weights(self, update: WeightUpdate) -> None:
        from vllm.lora.request import LoRARequest

        check_update(update, self._reference, self.version)
        path = write_adapter(self._dir / f"v{update.version}", lora_config(self.adapter, self.engine.model_dir),
                             update.state)
        lora = LoRARequest(f"{self.key}@v{update.version}", next(_IDS), str(path))
        self.engine.add_lora(lora)
        self._drop()
        self._lora, self.version = lora, update.version

    def close(self) -> None:
        self._drop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _drop(self) -> None:
        if self._lora is not None:
            self.engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
            self._lora = None
