"""The interface every generation backend implements, and the typed messages it exchanges.

Prompts arrive as token ids and responses leave as token ids with the log-prob of each sampled token, so
backends never see templates or text and the trainer can score exactly what was sampled. A response stays
columnar from here to the trainer: numpy arrays in the result, Arrow list columns in the store
(``scoring.sample_rows``), torch views in the trainer (``TrainBatch.from_arrow``); no token becomes a
Python object on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float  # 0 decodes greedily
    seed: int


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value; compare their fields
class GenerationResult:
    request_id: str
    response_ids: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the log-prob of each under the sampling distribution
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    policy_version: int  # weights that generated it

    def __post_init__(self) -> None:
        # the store's types (int32, float32); no copy when a backend already hands arrays of them
        object.__setattr__(self, "response_ids", np.asarray(self.response_ids, dtype=np.int32))
        object.__setattr__(self, "logprobs", np.asarray(self.logprobs, dtype=np.float32))


@dataclass(frozen=True)
class WeightUpdate:
    agent: str
    version: int
    state: dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightsLoaded:
    """A replica's answer to a weight sync: the version it holds afterwards, and the bytes it took in (0 when
    it held that version already)."""

    version: int
    nbytes: int


class WeightSyncError(RuntimeError):
    """A weight update that was refused or did not arrive; names the agent, replica and version."""


def check_update(update: WeightUpdate, reference: Mapping[str, torch.Tensor], current_version: int) -> None:
    """Refuse an update whose names, shapes or dtypes differ from ``reference`` (the model's state dict).

    Backends call this before any tensor reaches the model: a wrongly shaped tensor can kill a vLLM engine.
    ``reference`` may hold meta tensors, since only shapes and dtypes are compared.

    Raises:
        WeightSyncError: naming the agent, the version and up to five problems.
    """
    problems = [f"missing {name}" for name in sorted(reference.keys() - update.state.keys())]
    problems += [f"unexpected {name}" for name in sorted(update.state.keys() - reference.keys())]
    for name, tensor in update.state.items():
        expected = reference.get(name)
        if expected is not None and (tensor.shape != expected.shape or tensor.dtype != expected.dtype):
            problems.append(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
            )
    if problems:
        raise WeightSyncError(
            f"weight update v{update.version} for agent {update.agent!r} does not match the replica's model "
            f"({len(problems)} problems: {'; '.join(problems[:5])}); weights left at v{current_version}. The "
            "trainer and the replicas of an agent must load the same model directory"
        )


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
