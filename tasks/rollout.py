from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.orchestrator.runtime import RolloutSummary, RunContext, Runtime


# A retry is safe: each agent's commit of a step is keyed (rollout:<agent>, step + 1) and stored once.
@task(name="rollout", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, task_run_name="rollout-step-{step}")
def rollout_step(ctx: RunContext, step: int) -> RolloutSummary:
    """Run the step's MEG episodes on the replicas and commit every agent's samples to the store."""
    return Runtime.get(ctx).rollout(step)
