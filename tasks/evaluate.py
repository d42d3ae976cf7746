from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.config import RunConfig
from flexmarl.evaluate import EvalResult, evaluate_agent
from flexmarl.workloads.datasets import Problem


@task(name="evaluate-agent", cache_policy=NO_CACHE, task_run_name="evaluate-{agent}")
def evaluate(cfg: RunConfig, agent: str, model_dir: Path, tasks: list[Problem]) -> EvalResult:
    """Greedy answers of ``agent``'s weights in ``model_dir`` to the held-out tasks, scored by its reward."""
    return evaluate_agent(cfg, agent, model_dir, tasks)
