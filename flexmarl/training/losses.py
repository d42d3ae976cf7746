"""Pure loss functions of the GRPO family: advantages and the clipped policy loss.

Micro-batch losses are sums; the accumulated gradient is divided once by a normaliser of the agent's
whole global batch, so that it equals the full-batch gradient (a float64 test checks this to 1e-10).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def group_advantages(
    rewards: Sequence[float], groups: Sequence[str], *, eps: float = 1e-6, scale: bool = True
) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation.

    The standard deviation is the unbiased one (as in TRL); a group of equal rewards (a group of one
    included) gets exactly zero advantages, not the rounding error of its mean. ``scale=False`` keeps the
    centring only (Dr. GRPO).
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    keys = list(groups)
    for g in set(keys):
        idx = torch.tensor([i for i, k in enumerate(keys) if k == g])
        vals = r[idx]
        if bool(vals.max() == vals.min()):  # no variance: no signal (and dynamic sampling drops the group)
            continue
        centred = vals - vals.mean()
        if scale:
            std = vals.std() if len(vals) > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps)
        out[idx] = centred
    return out.tolist()


def agent_scaled(centred: Sequence[float], rewards: Sequence[float], *, eps: float = 1e-6) -> list[float]:
    """Dr. MAS: group-centred advantages over the std of the agent's rewards in its whole global batch."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if len(r) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return (torch.tensor(centred, dtype=torch.float64) / (std + eps)).tolist()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - policy; >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def _grpo_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # each response's mean token loss, summed over responses; later divided by the number of responses
    return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()


def _dapo_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # every token's loss, summed; later divided by the number of response tokens
    return (token_loss * mask).sum()


# loss_type -> (sum over a micro-batch, normaliser of the global batch from (responses, tokens, max length))
LOSS_TYPES: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[int, int, int], int]]] = {
    "grpo": (_grpo_sum, lambda responses, tokens, max_len: responses),
    "dapo": (_dapo_sum, lambda responses, tokens, max_len: tokens),
    "dr_grpo": (_dapo_sum, lambda responses, tokens, max_len: responses * max_len),
}


def batch_normaliser(loss_type: str, *, responses: int, tokens: int, max_len: int = 1) -> int:
    """What the summed micro-batch losses are divided by, once the global batch is known."""
    return max(LOSS_TYPES[loss_type][1](responses, tokens, max_len), 1)


def policy_loss(
    logprobs: torch.Tensor,  # (B, T) log-probs of the response tokens under the current weights
    old_logprobs: torch.Tensor,  # (B, T) log-probs under the weights the ratio is taken against
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 for response tokens, 0 for padding
    *,
    clip_eps: float,
    loss_type: str,
    clip_eps_high: float | None = None,  # upper clip range (DAPO clip-higher); None = clip_eps
    is_weights: torch.Tensor | None = None,  # (B, T) importance weights proximal/behaviour; None = 1
    ref_logprobs: torch.Tensor | None = None,  # (B, T) under the frozen reference, when kl_coef > 0
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate with GRPO advantages, summed over a micro-batch as ``loss_type`` says.

    The ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]`` (asymmetric with clip-higher). The sum is
    not yet normalised: the caller divides the accumulated gradient by ``batch_normaliser(...)`` of the whole
    global batch, so micro-batches add up to the full-batch gradient even when the global batch's size is
    known only at its end (pipelined training).

    ``clipfrac`` counts the response tokens whose clipped branch is the one the minimum picks, as TRL and
    verl do: ratio below ``1 - clip_eps`` with a negative advantage, or above ``1 + clip_eps_high`` with a
    positive one. A token outside the range on the other side keeps its unclipped (more pessimistic) term
    and its gradient, so it is not counted.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
    token_loss = -torch.minimum(unclipped, clipped)  # (B, T)
    if is_weights is not None:
        token_loss = token_loss * is_weights
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = k3_kl(logprobs, ref_logprobs)  # (B, T)
        token_loss = token_loss + kl_coef * kl
    loss = LOSS_TYPES[loss_type][0](token_loss, mask)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clip_active = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))  # (B, T)
        stats = {
            "clipfrac": float((clip_active.float() * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
        if kl is not None:
            stats["kl"] = float((kl * mask).sum() / n)
    return loss, stats
