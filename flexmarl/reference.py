"""A plain synchronous GRPO loop over the same components: the readable specification and a test oracle.

No scheduler, no cluster, no store: for each step, generate every node of every episode in graph order,
score the groups, train each agent on its whole batch in one ``AgentTrainer.train_step``, and load the new
weights into that agent's generator. It shares no scheduling code with the pipeline, so a test that finds
the pipeline's weights equal to these (``tests/flexmarl/test_reference.py``) checks the scheduler, the
commits, the store reads and the weight syncs at once. Strictly on-policy (``run.max_staleness`` 0), as
the ``sync`` schedule is.

Example:
    >>> weights = reference_run(load_config(preset="tiny", overrides=["run.steps=2"]))
    >>> sorted(weights)
    ['solver', 'verifier']
"""

from __future__ import annotations

from pathlib import Path

import torch

from flexmarl.config import RunConfig
from flexmarl.models.adapters import AdapterHost
from flexmarl.models.loading import load_model, load_tokenizer, resolve_model
from flexmarl.rollout.adapter_backend import AdapterBackend
from flexmarl.rollout.backend import GenerationRequest, WeightUpdate
from flexmarl.rollout.episodes import Episode, EpisodeGraph, NodeOutput, request_seed
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.rollout.replica import open_backend
from flexmarl.rollout.scoring import scale_by_agent, score
from flexmarl.training.trainer import AgentTrainer, TrainBatch
from flexmarl.workloads.datasets import problem_stream

Weights = dict[str, dict[str, torch.Tensor]]  # agent -> tensor name -> tensor

DRIFT_TOLERANCE = 1e-3
"""The ``weight_drift`` under which two runs trained the same weights. Two schedules of the same samples sum
micro-batches padded differently, and AdamW turns those float differences in near-zero gradient elements into
steps of up to the learning rate: measured 1e-4 of the move for the fan-out graph (one element in 65,536 off by
1.5e-4), while a lost all-reduce or micro-batch changes the move itself."""


def max_weight_diff(a: Weights, b: Weights) -> float:
    """The largest difference of any element between two teams' weights (reported beside ``weight_drift``)."""
    return max(float((a[agent][k] - b[agent][k]).abs().max()) for agent in a for k in a[agent])


def weight_drift(a: Weights, b: Weights, start: Weights) -> float:
    """How far ``b`` is from ``a``, as a share of how far ``a`` moved from ``start``: the L2 norm over each agent's
    tensors, the largest over agents. An agent that did not move must be equal, or the drift is infinite."""
    worst = 0.0
    for agent, tensors in a.items():
        diff = sum(float((tensors[k].double() - b[agent][k].double()).square().sum()) for k in tensors) ** 0.5
        move = sum(float((tensors[k].double() - start[agent][k].double()).square().sum()) for k in tensors) ** 0.5
        worst = max(worst, diff / move if move > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def reference_run(cfg: RunConfig, *, steps: int | None = None) -> Weights:
    """Train every agent for ``steps`` (default ``cfg.run.steps``) synchronous steps; returns the weights.

    Raises:
        ValueError: the config asks for stale samples, which a synchronous loop never has.
    """
    if any(cfg.run.max_staleness or spec.max_staleness for spec in cfg.agents.values()):
        raise ValueError("the reference loop is on-policy: set run.max_staleness=0")
    model_dirs = {a: str(resolve_model(spec.model, seed=cfg.run.seed)) for a, spec in cfg.agents.items()}
    graph = EpisodeGraph(cfg, {a: load_tokenizer(Path(d)) for a, d in model_dirs.items()})
    trainer_cfg = {a: cfg.trainer_config(a) for a in cfg.agents}
    # adapter agents of one model share a base for generating and one for training, as on a worker
    shared = {model_dirs[a] for a, spec in cfg.agents.items() if spec.adapter is not None}
    hosts = {(use, d): AdapterHost(d, HFBackend.default_device()) for d in shared for use in ("rollout", "train")}
    generators = {
        a: AdapterBackend(hosts["rollout", model_dirs[a]], a, spec.adapter) if spec.adapter is not None
        else open_backend(model_dirs[a], 0, cfg.rollout)
        for a, spec in cfg.agents.items()
    }
    trainers = {
        a: AgentTrainer(a, model_dirs[a], trainer_cfg[a], temperature=spec.sampling.temperature,
                        max_new_tokens=spec.sampling.max_new_tokens, host=hosts.get(("train", model_dirs[a])))
        for a, spec in cfg.agents.items()
    }
    problems = problem_stream(cfg.data)
    group = cfg.run.group_size

    for step in range(steps if steps is not None else cfg.run.steps):
        # ---- generate all: node by node in graph order, every episode at once
        inputs = problems.batch(step, cfg.run.queries_per_step)
        episodes = [Episode(problem, j, step) for problem in inputs for j in range(group)]
        for node in graph.order:
            agent = graph.agent_of[node]
            todo = [ep for ep in episodes if node not in ep.skipped]  # a loop's early stop skips later turns
            sampling = cfg.agents[agent].sampling
            requests = []
            for ep in todo:
                sid = graph.sample_id(ep, node)
                requests.append(GenerationRequest(sid, graph.prompt(ep, node), sampling.max_new_tokens,
                                                  sampling.temperature, request_seed(cfg.run.seed, sid)))
            for ep, request, result in zip(todo, requests, generators[agent].generate(requests), strict=True):
                graph.record(ep, node, request.prompt_ids, result)

        # ---- score: rewards, then advantages within each group (one query's episodes)
        for q in range(len(inputs)):
            score(episodes[q * group:(q + 1) * group], cfg, trainer_cfg)

        # ---- train: each agent's whole batch, one optimizer step; then its generator gets the weights
        for agent, trainer in trainers.items():
            outputs = [o for ep in episodes if ep.error is None for o in ep.outputs.values() if o.agent == agent]
            if trainer_cfg[agent].advantage == "agent":
                scale_by_agent(outputs, eps=trainer_cfg[agent].adv_eps)
            rewarded = sorted((o for o in outputs if o.reward is not None), key=lambda o: o.sample_id)
            trainer.train_step(_batch(rewarded))
            generators[agent].update_weights(WeightUpdate(agent, trainer.version, trainer.weights()))
    return {agent: trainer.weights() for agent, trainer in trainers.items()}


def initial_weights(cfg: RunConfig) -> Weights:
    """Each agent's weights before its first update, as ``reference_run(cfg, steps=0)`` gives them: the model's
    (an adapter agent's: its fresh adapter's, whose random A matrices are seeded by the agent's name), loaded one
    agent at a time, without a trainer (whose accelerator settings are one per process) or a generator."""
    weights = {}
    for agent, spec in cfg.agents.items():
        model_dir = resolve_model(spec.model, seed=cfg.run.seed)
        if spec.adapter is None:
            weights[agent] = load_model(model_dir).state_dict()
        else:
            host = AdapterHost(str(model_dir), torch.device("cpu"))
            weights[agent] = {k: v.detach().clone() for k, v in host.state(host.add(agent, spec.adapter)).items()}
    return weights


def _batch(outputs: list[NodeOutput]) -> TrainBatch:
    return TrainBatch(
        sample_ids=[o.sample_id for o in outputs],
        prompt_ids=[o.prompt_ids for o in outputs],
        response_ids=[o.result.response_ids for o in outputs],
        logprobs=[o.result.logprobs for o in outputs],
        advantages=[o.advantage for o in outputs],
        versions=[o.result.policy_version for o in outputs],
    )
