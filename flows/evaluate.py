"""The evaluate flow: score a run's agent, at its latest checkpoint or its base model, on held-out problems.

    prefect deployment run 'flexmarl-evaluate/latest' --param run_dir=runs/default
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flexmarl.config import load_config
from flexmarl.evaluate import held_out_problems, latest_checkpoint
from flexmarl.models.loading import resolve_model
from flexmarl.run.layout import CONFIG_FILE
from tasks.evaluate import evaluate


@flow(name="flexmarl-evaluate")
def evaluate_run(
    run_dir: str, agent: str = "solver", n: int = 64, data_path: str | None = None, base: bool = False
) -> dict:
    """Score ``agent`` of the run in ``run_dir`` on ``n`` held-out problems.

    Args:
        run_dir: a run directory (its config.yaml and checkpoints/ are read).
        agent: a root agent of the graph (one whose prompt reads only problem fields).
        n: number of held-out problems.
        data_path: a GSM8K-style JSONL file of held-out problems (its first ``n``); default: the run's
            reasoning-gym dataset with another seed, so no problem was seen in training. Required when the run
            trained on a file.
        base: score the agent's starting model instead of its latest checkpoint.
    """
    path = Path(run_dir).resolve()
    cfg = load_config(path / CONFIG_FILE)
    if agent not in cfg.agents:
        raise ValueError(f"unknown agent {agent!r}; the run's agents are {sorted(cfg.agents)}")
    model_dir = None if base else latest_checkpoint(path, agent)
    model_dir = model_dir or resolve_model(cfg.agents[agent].model, seed=cfg.run.seed)
    problems = held_out_problems(cfg.data, n, path=Path(data_path) if data_path else None)
    result = evaluate(cfg, agent, model_dir, problems)
    get_run_logger().info("%s at %s: mean reward %.3f on %d problems", agent, model_dir, result.mean_reward, result.n)
    summary = {"agent": agent, "model_dir": str(model_dir), "n": result.n, "mean_reward": result.mean_reward,
               "parsed_fraction": result.parsed_fraction}
    create_table_artifact([summary], key=f"evaluation-{agent.replace('_', '-')}", description="Held-out score")
    return {**summary, "examples": result.examples}
