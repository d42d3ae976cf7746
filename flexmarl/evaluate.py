"""Score one agent's weights on held-out tasks: the agent answers each task once, its reward scores it.

Used by the evaluate flow (``flows/evaluate.py``). Only agents whose prompt reads task fields alone (the
roots of the graph, e.g. a solver) can be scored in isolation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flexmarl.config import RunConfig
from flexmarl.models.loading import load_tokenizer
from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.episodes import render_prompt
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.workloads.datasets import TaskItem
from flexmarl.workloads.registry import PARSERS, REWARDS
from flexmarl.workloads.rewards import RewardInput


@dataclass(frozen=True)
class EvalResult:
    agent: str
    model_dir: str
    n: int
    mean_reward: float
    parsed_fraction: float  # answers the agent's parser could read
    examples: list[dict]  # the first few (question, response, parsed, reward)


def evaluate_agent(
    cfg: RunConfig, agent: str, model_dir: str | Path, tasks: list[TaskItem], *, batch_size: int = 16,
    temperature: float = 0.0,
) -> EvalResult:
    """Generate one answer per task (greedy by default) and average the agent's reward."""
    spec = cfg.agents[agent]
    nodes = [n for n in cfg.nodes_of(agent) if not cfg.graph.expanded.parents(n)]
    if not nodes:
        raise ValueError(f"agent {agent!r} reads other nodes' outputs; evaluate a root agent of the graph")
    node = nodes[0]
    tok = load_tokenizer(Path(model_dir))
    backend = HFBackend(model_dir)
    rewards, parsed_count, examples = [], 0, []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        requests = [
            GenerationRequest(t.input_id, render_prompt(tok, spec.prompt, spec.system, t.fields),
                              spec.sampling.max_new_tokens, temperature, seed=i)
            for i, t in enumerate(chunk, start=start)
        ]
        for task, result in zip(chunk, backend.generate(requests), strict=True):
            text = tok.decode(result.response_ids, skip_special_tokens=True)
            parsed = PARSERS[spec.parser](text)
            reward = REWARDS[spec.reward](RewardInput(node, parsed, task, {node: parsed}, [], (node,)))
            rewards.append(reward)
            parsed_count += parsed is not None
            if len(examples) < 5:
                examples.append({"question": task.fields.get("question", ""), "response": text, "parsed": parsed,
                                 "reward": reward})
    return EvalResult(agent, str(model_dir), len(tasks), sum(rewards) / max(len(rewards), 1),
                      parsed_count / max(len(tasks), 1), examples)
