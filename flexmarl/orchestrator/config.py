"""Settings of the training loop that the orchestrator drives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict


class TrainLoopConfig(Strict):
    steps: int = Field(2, ge=1)
    """Optimizer steps per agent."""
    mode: Literal["sync"] = "sync"
    """'sync': generate the whole global batch, then train every agent, then sync weights."""
    queries_per_step: int = Field(4, ge=1)
    """Task inputs per step."""
    group_size: int = Field(4, ge=2)
    """Samples per input and node (the GRPO group); advantages are normalised within a group."""
    seed: int = 0
    """Seeds model building, sampling and the task order."""
    save_checkpoints: bool = True
    """Save each agent's final weights under RUN_DIR/checkpoints/<agent>/v<version>."""
