"""Settings of the per-agent trainers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict


class TrainerConfig(Strict):
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    """How token losses are averaged over the agent's global batch:
    'grpo': mean over each response's tokens, then mean over responses (GRPO paper; a long answer weighs
    as much as a short one, so each of its tokens weighs less);
    'dapo': mean over every token of the batch (DAPO; each token weighs the same);
    'dr_grpo': sum over tokens divided by responses x max_new_tokens, a constant (Dr. GRPO; removes the
    length bias of both)."""
    advantage: Literal["group", "group_mean", "agent"] = "group"
    """How rewards become advantages:
    'group': minus the GRPO group's mean, over the group's standard deviation (GRPO);
    'group_mean': minus the group's mean only (Dr. GRPO: no difficulty bias from the std);
    'agent': minus the group's mean, over the standard deviation of this agent's rewards in the whole global
    batch (Dr. MAS, agent-wise normalisation). Needs the whole batch first, so this agent's micro-batches
    are committed when its batch is complete: no micro-batch pipelining for it."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL estimate to the frozen starting weights (a reference model in memory); 0: none."""
    slots: int | None = Field(None, ge=1)
    """Training slots (workers that train) shared by all agents, M <= N allowed; null: one per training
    worker. Run-wide: an agent's own ``training`` cannot set it."""
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
