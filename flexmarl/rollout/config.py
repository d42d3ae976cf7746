"""Settings of the rollout engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict


class RolloutConfig(Strict):
    backend: Literal["hf"] = "hf"
    """Generation backend: 'hf' (Hugging Face transformers, CPU or GPU)."""
    load_balance: bool = True
    """Give every agent a replica on every worker and send each batch to the free replica with the fewest
    outstanding tokens, so idle capacity serves whichever agent has work; false keeps one replica per agent
    on its home worker (the no-lb ablation, and the 'sync' baseline's dedicated engines)."""
    max_batch_size: int = Field(32, ge=1)
    """Most requests one replica generates in one batch; waiting requests join the next batch."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for a weight sync to one replica. Past it the replica counts as hung: its worker is restarted
    through its nanny and its engines are rebuilt elsewhere; a worker without a nanny fails the run, naming agent,
    replica and version."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for one generation batch (from its submission). Past it the replica counts as hung: its worker
    is restarted through its nanny, its engines are rebuilt and the batch is generated again; a worker without a
    nanny fails the run, naming agent and replica."""
