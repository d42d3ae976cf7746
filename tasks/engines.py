from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.orchestrator.runtime import RunContext, Runtime


@task(name="start-engines", cache_policy=NO_CACHE)
def start_engines(ctx: RunContext) -> dict[str, dict]:
    """Load every agent's rollout replicas and trainer on their Dask workers; returns the placement."""
    return Runtime.get(ctx).start_engines()


@task(name="save-checkpoint", cache_policy=NO_CACHE, task_run_name="checkpoint-{agent}")
def save_checkpoint(ctx: RunContext, agent: str) -> str:
    """Save the agent's current weights and tokenizer under RUN_DIR/checkpoints/<agent>/v<version>."""
    return Runtime.get(ctx).checkpoint(agent)
