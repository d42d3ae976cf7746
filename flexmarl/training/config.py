"""Settings of the per-agent trainers."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from flexmarl.configbase import Strict
from flexmarl.models.adapter_config import AdapterConfig

LossType = Literal["grpo", "dapo", "dr_grpo"]


class TrainerConfig(Strict):
    RUN_WIDE: ClassVar[tuple[str, ...]] = ("slots", "mixed_precision", "state_uri", "state_storage_options")
    """Fields an agent's own ``training`` block cannot override: they describe the slots, not the agent."""

    loss_type: LossType = "grpo"
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
    mixed_precision: Literal["no", "bf16"] = "no"
    """Accelerate's mixed precision for every trainer: 'no' (float32) or 'bf16' (bfloat16 autocast, on CPU or
    GPU). The master weights and the Adam moments stay float32, and so does what a state move carries.
    'fp16' is refused: it needs a loss scale per agent, and accelerate keeps one loss scaler per process,
    shared by every agent a worker trains. Run-wide: accelerate allows one configuration per process, so a
    worker that trained one run cannot train another with a different value (restart the workers)."""
    state_uri: str | None = None
    """Where a training state is parked when its agent moves to a slot on another worker: a directory, or
    an fsspec URI ('file:///shared/x', 's3://bucket/prefix'; 'memory://x' only when every worker is a
    thread of one process). null: 'state/' in the run directory. Every worker must reach it. Run-wide."""
    state_storage_options: dict[str, str] = {}
    """fsspec storage options for ``state_uri`` (credentials, endpoint), e.g. {key: ..., secret: ...}."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up, then constant (transformers'
    'constant_with_warmup'): update k (from 0) uses lr * k / lr_warmup_steps, so the first update has lr 0.
    0: constant lr from the first update. Its state moves with the agent's training state."""
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range of the probability ratio to the proximal policy: [1 - clip_eps, 1 + clip_eps_high].
    The proximal policy is the current weights (decoupled PPO, see ``is_cap``) and FlexMARL takes one
    optimizer step per global batch, so the ratio is exactly 1 and the clip does not bind today (as in
    TRL with ``num_iterations=1``); it would with several optimizer steps per batch. The rollout/trainer
    mismatch is bounded by ``is_cap`` instead. Metric ``policy/clipfrac``: the share of response tokens
    whose clipped branch is active (as TRL and verl count it)."""
    clip_eps_high: float | None = Field(None, gt=0)
    """Upper clip range (DAPO's clip-higher, 0.28 in the paper): the ratio is clipped to
    [1 - clip_eps, 1 + clip_eps_high], so that low-probability tokens with a positive advantage can grow
    more before the clip stops them. null: the same as ``clip_eps`` (the symmetric PPO clip)."""
    micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward; gradients accumulate over the agent's global batch. Whole GRPO groups:
    a multiple of ``run.group_size`` times the agent's nodes (validation names the value to use)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping norm; null turns clipping off."""
    is_cap: float = Field(2.0, gt=0)
    """Cap of the per-token importance weight min(pi_current / pi_behaviour, is_cap), which corrects every
    sample from the policy that generated it (the rollout engine's log-probs) to the current weights
    (decoupled PPO, AReaL's 'clamp'; TRL's truncated IS). Fresh samples take the same path: the weight is 1
    when the rollout engine and the trainer agree, and a numerics mismatch (a bf16 engine against a float32
    trainer) cannot silently clip their gradients. Stale samples (``max_staleness`` > 0) are corrected for
    their older policy. Metrics: ``policy/is_weight_mean`` and ``policy/is_weight_at_cap`` (share of
    response tokens at the cap)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group's reward standard deviation when normalising advantages."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the GRPO groups whose rewards have no variance (all equal, and every
    group of one), and the groups a ``MIXED_ONLY`` reward such as ``verdict_mixed`` gives no advantage, before
    training. Their advantages are 0, so they carry no policy gradient, yet they cost a
    forward/backward and dilute the normaliser (they count as responses or tokens). Dropped samples stay in
    the store (status 'rewarded', advantage 0) but no update consumes them; each update reports how many groups it
    dropped as ``groups/dropped_zero_variance``. A micro-batch left empty is not trained; a global batch left empty
    still completes its step: the version advances (versions count global batches) with the weights, the
    optimizer and the lr schedule untouched, and the update consumes nothing. Dropped groups are not
    replaced by new queries (DAPO's over-sampling), so a batch trains on fewer groups. With ``kl_coef`` > 0
    the dropped samples' KL term is lost too. Off by default, as in TRL and verl (DAPO turns it on): it
    changes the effective batch size and so the step size tuned for a preset."""

    max_slots: int = Field(1, ge=1)
    """The most training slots one agent's trainer may span: a trainer group, data parallel (every rank holds a
    whole copy of the agent's state, trains whole micro-batches of its step, and the gradient sums are
    all-reduced at the optimizer step, so every rank takes the same step). The scheduler grows an agent's
    group into idle slots while no other agent waits for a slot and the step ends sooner by more than the
    rank costs (the join's state copy, the larger all-reduce, moving an agent whose home the slot is: priced
    from what the agent's jobs have taken), and frees them at the step's end. 1: one slot per agent. Above
    ``training.slots`` is refused. A sharded agent (``sharding`` 'optimizer' or 'full') spans exactly this
    many slots, for the whole run."""
    sharding: Literal["none", "optimizer", "full"] = "none"
    """How a trainer group's ranks divide the agent's state: 'none' (data parallel: each rank a whole copy);
    'optimizer' (ZeRO-1, torch's ``ZeroRedundancyOptimizer``: each rank holds the whole weights and gradients
    and 1/k of the Adam moments, steps its share of the parameters and broadcasts them); 'full' (FSDP2
    ``fully_shard``: each rank holds 1/k of the weights, gradients and Adam moments). A sharded agent ('optimizer'
    or 'full') spans the first ``max_slots`` training slots for the whole run, each of its steps binding them all,
    and every rank trains its part of each micro-batch; the run's sharded agents share those ranks (the same
    ``max_slots``) and take turns, a step each; not an adapter agent; a lost rank's group is rebuilt at its
    step's start, by all its new ranks together (from that version's snapshot, or by replaying the store's
    updates since the one before it)."""

    adapter: AdapterConfig | None = None
    """Set from ``agents.<name>.adapter`` (the one place to write it): train a LoRA adapter, not the whole model."""

    @property
    def sharded(self) -> bool:
        """The agent's state is divided over its ranks ('optimizer' or 'full'), which it holds for the whole run."""
        return self.sharding != "none"

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _no_fp16(cls, value: object) -> object:
        if value == "fp16":
            raise ValueError(
                "'fp16' is not supported: it needs a loss scale per agent, and accelerate keeps one per process, "
                "shared by every agent a worker trains; use 'bf16' (or 'no')"
            )
        return value
