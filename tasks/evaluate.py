from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flexmarl.config import RunConfig
from flexmarl.evaluate import TeamRun, evaluation_report
from flexmarl.workloads.datasets import Problem


@task(name="evaluate-team", cache_policy=NO_CACHE)
def evaluate_team(client, cfg: RunConfig, trained_dirs: Mapping[str, Path], base_dirs: Mapping[str, Path],
                  problems: Sequence[Problem], *, batch_size: int) -> tuple[dict, list[TeamRun]]:
    """The trained and the base team's greedy episodes on the held-out problems, spread over the cluster."""
    return evaluation_report(client, cfg, trained_dirs, base_dirs, problems, batch_size=batch_size)
