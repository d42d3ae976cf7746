from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.orchestrator.runtime import RunContext, Runtime, UpdateSummary


@task(name="update-agent", cache_policy=NO_CACHE, task_run_name="update-{agent}-step-{step}")
def update_agent(ctx: RunContext, agent: str, step: int, samples_version: int) -> UpdateSummary:
    """One GRPO update of ``agent`` on its samples at Delta version ``samples_version``, then a weight sync."""
    return Runtime.get(ctx).update(agent, step, samples_version)
