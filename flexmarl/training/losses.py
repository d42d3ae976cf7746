"""Pure loss functions of the GRPO family: advantages and the clipped policy loss.

Normalisers are passed in, computed once over the agent's whole global batch, so that the sum of the
micro-batch losses equals the full-batch loss and accumulated gradients equal the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float], groups: Sequence[str], *, eps: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation.

    The standard deviation is the unbiased one (as in TRL); a group of equal rewards gets zero advantages.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    keys = list(groups)
    for g in set(keys):
        idx = torch.tensor([i for i, k in enumerate(keys) if k == g])
        vals = r[idx]
        std = vals.std() if len(vals) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out[idx] = (vals - vals.mean()) / (std + eps)
    return out.tolist()


@dataclass(frozen=True)
class BatchNorm:
    """Sizes of the agent's whole global batch, for exact micro-batch accumulation."""

    num_sequences: int
    num_tokens: int


def _grpo_reduce(token_loss: torch.Tensor, mask: torch.Tensor, norm: BatchNorm) -> torch.Tensor:
    # mean over each response's tokens, then mean over the global batch's responses
    per_seq = (token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / norm.num_sequences


def _dapo_reduce(token_loss: torch.Tensor, mask: torch.Tensor, norm: BatchNorm) -> torch.Tensor:
    # mean over every response token of the global batch
    return (token_loss * mask).sum() / norm.num_tokens


REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchNorm], torch.Tensor]] = {
    "grpo": _grpo_reduce,
    "dapo": _dapo_reduce,
}


def policy_loss(
    logprobs: torch.Tensor,  # (B, T) log-probs of the response tokens under the current weights
    old_logprobs: torch.Tensor,  # (B, T) log-probs under the weights that sampled them
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 for response tokens, 0 for padding
    *,
    norm: BatchNorm,
    clip_eps: float,
    loss_type: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate with GRPO advantages, reduced as ``loss_type`` says.

    Returns the loss of this micro-batch (already scaled to its share of the global batch) and stats.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    token_loss = -torch.minimum(unclipped, clipped)  # (B, T)
    loss = REDUCTIONS[loss_type](token_loss, mask, norm)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "clipfrac": float(((unclipped != clipped).float() * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
    return loss, stats
