"""The interface every generation backend implements, and the typed messages it exchanges.

Prompts arrive as token ids and responses leave as token ids with the log-prob of each sampled token, so
backends never see templates or text and the trainer can score exactly what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float  # 0 decodes greedily
    seed: int


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    response_ids: list[int]
    logprobs: list[float]  # log-prob of each response token under the sampling distribution
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    policy_version: int  # weights that generated it


@dataclass(frozen=True)
class WeightUpdate:
    agent: str
    version: int
    state: dict[str, torch.Tensor]


class WeightSyncError(RuntimeError):
    """A weight update that was refused or did not arrive; names the agent, replica and version."""


class GenerationBackend(Protocol):
    version: int

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Sample one response per request (requests of one call are batched together)."""
        ...

    def update_weights(self, update: WeightUpdate) -> None:
        """Validate names, shapes and dtypes, then replace the weights and adopt ``update.version``.

        Raises:
            WeightSyncError: the update does not match the model; the weights are left untouched.
        """
        ...
