"""A rollout replica of an adapter agent: its LoRA adapter on a base model it shares with other agents.

Generation is the HF backend's (same sampling, same seeds, same log-probs), run with the agent's adapter
active in the shared base; a weight update carries only the adapter's tensors. The replicas of every adapter
agent of one model on a worker share that worker's one copy of the base, so the inter-agent balancer can give
a worker's capacity to any of them without moving model weights.
"""

from __future__ import annotations

from pathlib import Path

from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.adapters import AdapterHost
from flexmarl.models.loading import check_tokenizer_matches, load_tokenizer
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightUpdate, check_update
from flexmarl.rollout.config import Decode
from flexmarl.rollout.hf_backend import HFBackend


class AdapterBackend(HFBackend):
    """One agent's replica: adapter ``agent`` (as ``adapter`` describes it) in ``host``."""

    def __init__(self, host: AdapterHost, agent: str, adapter: AdapterConfig, *, version: int = 0,
                 decode: Decode = "dynamic") -> None:
        tok = load_tokenizer(Path(host.model_dir))
        self.device, self.pad_id, self.eos_id = host.device, tok.pad_token_id, tok.eos_token_id
        self.host, self.adapter = host, host.add(agent, adapter)
        self.model = host.model.eval()  # what the HF backend's decode loop runs: the shared base, with adapters
        check_tokenizer_matches(self.model, tok, Path(host.model_dir))
        self.version = version
        self.decode, self._compiled = decode, None

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self.host.active(self.adapter):
            return super().generate(requests)

    def update_weights(self, update: WeightUpdate) -> None:
        check_update(update, self.host.state(self.adapter), self.version)
        self.host.load_state(self.adapter, update.state)
        self.version = update.version

    def close(self) -> None:
        self.host.remove(self.adapter)
