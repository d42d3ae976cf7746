"""Settings of the training loop that the orchestrator drives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict

TrainMode = Literal["flexmarl", "sync"]


class RunLoopConfig(Strict):
    steps: int = Field(2, ge=1)
    """Optimizer steps per agent."""
    mode: TrainMode = "flexmarl"
    """'flexmarl': agents train on their own clocks, micro-batches while the batch is still generated
    (the paper's pipeline); 'sync': the baseline: generate the whole global batch layer by layer for every
    agent, barrier, train every agent, sync weights, repeat."""
    pipeline: bool = True
    """In 'flexmarl' mode, train each committed micro-batch at once; false waits for the agent's whole batch
    (the no-pipeline ablation)."""
    max_staleness: int = Field(0, ge=0)
    """How many versions behind the trained weights a sample's generator may be (opt-in, beyond the paper);
    0 is strictly on-policy: the weights equal those of 'sync'. Stale samples get capped importance weights.
    An agent's own ``max_staleness`` overrides it."""
    queries_per_step: int = Field(4, ge=1)
    """Task inputs per step."""
    group_size: int = Field(4, ge=2)
    """Samples per input and node (the GRPO group); advantages are normalised within a group."""
    seed: int = 0
    """Seeds model building, sampling and the task order."""
    save_checkpoints: bool = True
    """Save each agent's final weights under RUN_DIR/checkpoints/<agent>/v<version>."""
    save_state: bool = True
    """Write each agent's whole training state (weights, Adam moments, version, RNG) every ``snapshot_every``
    versions, to <training.state_uri>/by-version/<agent>/v<version> (default RUN_DIR/state/...; the newest
    ones are kept). It is the cut that a lost trainer, a lost replica and ``flexmarl train --resume`` restart
    from; false saves the writes, but then only a run still at version 0 can recover or resume."""
    snapshot_every: int = Field(1, ge=1)
    """Write an agent's training state after every k-th update only (versions k, 2k, ... and the last). A
    state needed at another version (a lost trainer or replica, a resume) is rebuilt exactly on a worker by
    replaying the updates the store recorded since the snapshot before it (training/replay.py); a sharded
    agent's by all its ranks together, and its new rollout engines catch up from the trainer. A state
    costs 16 bytes per parameter (1.7 GB for SmolLM2-135M). It is copied to host memory before its update is
    recorded and written in the background (the last one before the run ends), but the write still takes the
    trainer worker's disk and a core: size k so that writing is a few percent of an update (the default
    preset: 4); a small model's state costs next to nothing, so 1 keeps recovery instant."""
