"""Settings of the per-agent trainers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict


class TrainerConfig(Strict):
    loss_type: Literal["grpo", "dapo"] = "grpo"
    """How token losses are averaged:
    'grpo': mean over each response's tokens, then mean over responses (GRPO paper; long answers weigh
    as much as short ones);
    'dapo': mean over every token of the global batch (DAPO; each token weighs the same)."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range of the probability ratio."""
    micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward; gradients accumulate over the agent's global batch."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm; null turns clipping off."""
    is_cap: float = Field(2.0, gt=0)
    """Cap of the importance weight current/behaviour policy for stale samples (``max_staleness`` > 0)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group's reward standard deviation when normalising advantages."""
