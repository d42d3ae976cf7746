"""The run's coarse engine calls, each a task that attaches to the run by its ``RunContext`` and ``Placement``."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.orchestrator.runtime import Placement, RunContext, Runtime


@task(name="start-engines", cache_policy=NO_CACHE)
def start_engines(ctx: RunContext) -> Placement:
    """Load every agent's rollout replicas and trainer on their Dask workers; returns where they are."""
    runtime = Runtime(ctx)
    try:
        return runtime.start_engines()
    finally:
        runtime.disconnect()  # the engines stay: the flow frees them when the run ends


@task(name="save-checkpoint", cache_policy=NO_CACHE, task_run_name="checkpoint-{agent}")
def save_checkpoint(ctx: RunContext, placement: Placement, agent: str) -> str:
    """Save the agent's current weights and tokenizer under RUN_DIR/checkpoints/<agent>/v<version>."""
    runtime = Runtime(ctx, placement=placement)
    try:
        return runtime.checkpoint(agent)
    finally:
        runtime.disconnect()
