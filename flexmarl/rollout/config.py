"""Settings of the rollout engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict


class RolloutConfig(Strict):
    backend: Literal["hf"] = "hf"
    """Generation backend: 'hf' (Hugging Face transformers, CPU or GPU)."""
    slots_per_worker: int = Field(2, ge=1)
    """Replica slots on each rollout worker: each generates one batch at a time for one agent. Agents take
    the slots round-robin at the start; a second slot on a worker queues its next batch behind the first, so
    the worker never waits for the driver."""
    load_balance: bool = True
    """Inter-agent balancing: move idle replica slots from agents with short queues to agents with long ones
    (every rollout worker then holds an engine of every agent, so a move is immediate). False keeps the
    starting assignment and loads each agent only where its slots are (the no-lb ablation, and the 'sync'
    baseline's dedicated engines). Within an agent, a batch always goes to the free slot whose worker has the
    fewest tokens outstanding."""
    balance_threshold: float = Field(5.0, ge=0)
    """Move a slot when the longest queue exceeds the shortest by more than this many waiting requests per
    slot (the paper's disparity threshold)."""
    balance_cooldown_s: float = Field(0.5, ge=0)
    """Hysteresis: an agent that gained a slot gives none back, and one that gave a slot takes none, for this
    long (seconds)."""
    max_batch_size: int = Field(32, ge=1)
    """Most requests one replica generates in one batch; waiting requests join the next batch."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for a weight sync to one replica before the run fails, naming agent, replica and version."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for one generation batch before the run fails with the agent and replica named."""
