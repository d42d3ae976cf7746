"""How long a run will take, said before it starts: the config's token counts priced at measured costs.

The costs are seconds on one worker of this project's 2-core machine (one torch thread per worker), fitted to the
busy seconds of `make run` on an idle machine (docs/performance.md, "The run estimate"): a generated token, a
prompt position of the rollout's prefill, a trained sample and each of its positions, the weight sync of an update
and each state written (1.7 GB every ``run.snapshot_every`` updates). Prompts count their positions as
``models/prefix.py`` runs them: a micro-batch's shared head and a group's repeated prompt once
(``prompt_positions``). With dynamic sampling, only the samples of groups with a learning signal are trained:
``TRAINED_SHARE`` of them. The tiny models cost little but the pipeline's per-step overhead. Other models have
no price, and get no estimate. It is a rough guide for an idle machine (a loaded one is slower: the copy preset,
estimated at 3 minutes, took 10 on a machine running two other trainings); the run's own progress lines give the
measured pace once an update is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from flexmarl.config import RunConfig
from flexmarl.models.loading import load_tokenizer, resolve_model
from flexmarl.models.prefix import prefill_positions
from flexmarl.rollout.episodes import render_prompt
from flexmarl.workloads.datasets import Problem, load_problems


@dataclass(frozen=True)
class TokenCosts:
    decode_s: float  # one generated token of one sample, in a batch
    prefill_s: float  # one prompt position of the rollout's prefill
    train_s: float  # one position (prompt or response) of a trained sample, forward and backward
    sample_s: float  # per trained sample, beside its positions (the micro-batch's fixed work, shared out)
    update_s: float  # per optimizer step: the weight sync to the rollout replicas
    snapshot_s: float  # per training state written (run.snapshot_every)


# SmolLM2: fitted to `make run` of the solver-verifier team (24 steps, idle): rollout 0.196 s per solver sample
# (11 tokens, 4 prompt positions) and 0.284 s per verifier sample (16 tokens, 86), training 0.46 and 0.74 s per
# trained sample (16 and 102 positions), sync 0.5 s per update, a state's host copy 1.3 s.
COSTS = {
    "smollm2-135m-instruct": TokenCosts(decode_s=0.0162, prefill_s=2.8e-4, train_s=3.3e-3, sample_s=0.41,
                                        update_s=0.5, snapshot_s=1.3),
    "tiny": TokenCosts(decode_s=2e-4, prefill_s=1.7e-5, train_s=5e-5, sample_s=0.0, update_s=1.5, snapshot_s=0.0),
    "tiny-large": TokenCosts(decode_s=4e-4, prefill_s=7e-5, train_s=2e-4, sample_s=0.0, update_s=1.5,
                             snapshot_s=0.0),
}
PACE = 1.2
"""This machine's pace on the same work moved by 1.3x between idle days: the costs above are the fastest day's, and
the estimate is scaled to the middle of the three idle runs measured, which it then meets within 16%
(docs/performance.md, "The run estimate")."""
TRAINED_SHARE = 0.45
"""With ``training.dynamic_sampling``, the share of samples in groups with a learning signal, the ones trained:
49% of the solver's and 41% of the verifier's in that `make run`."""
LATER_TURN_SHARE = 0.6
"""The share of episodes that run a loop's later turns, where an early stop may skip them: the default team's
verifier rejected 60% of the solver's first answers over the first 24 steps of `bench learning` (2026-12-07;
docs/performance.md, "The run estimate")."""


def expected_runs(cfg: RunConfig, node: str) -> float:
    """How many instances of the declared ``node`` an episode runs on average: each instance an early stop may
    skip counts ``LATER_TURN_SHARE``."""
    skippable = {n for rule in cfg.graph.expanded.stop_rules() for n in rule.skip}
    return sum(LATER_TURN_SHARE if n in skippable else 1.0 for n in cfg.graph.expanded.instances(node))


def agent_tokenizer(cfg: RunConfig, agent: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``agent``'s model (loaded for each node the estimate prices: a fraction of a second each)."""
    return load_tokenizer(Path(resolve_model(cfg.agents[agent].model, seed=cfg.run.seed)))


def typical_prompt(cfg: RunConfig, node: str, problem: Problem, tok: PreTrainedTokenizerBase, filler: str = "x"
                   ) -> list[int]:
    """The token ids of a prompt of the declared ``node``: its template on ``problem``, each parent's output a
    full ``max_new_tokens`` of ``filler`` words."""
    graph = cfg.graph.expanded
    role, first = cfg.declared_role(node), graph.instances(node)[0]
    parents = {p: f"{filler} " * cfg.agents[graph.node(p).agent].sampling.max_new_tokens for p in graph.parents(first)}
    return render_prompt(tok, role.prompt, role.system, {**problem.fields, **graph.render_fields(first, parents)})


def prompt_tokens(cfg: RunConfig, node: str, problem: Problem) -> int:
    """Tokens of a typical prompt of the declared ``node`` (``typical_prompt``)."""
    return len(typical_prompt(cfg, node, problem, agent_tokenizer(cfg, cfg.declared_role(node).agent)))


def prompt_positions(cfg: RunConfig, node: str, problems: list[Problem]) -> float:
    """Prompt positions one sample of the declared ``node`` costs when a micro-batch's prompts run through
    ``prefix.prefill``: their common head once, each distinct prompt's rest once. A group shares its problem;
    a node with parents quotes their answers, so its prompts differ (filler answers of ``max_new_tokens``
    stand in, a different filler per sample)."""
    agent = cfg.declared_role(node).agent
    tok, micro = agent_tokenizer(cfg, agent), cfg.trainer_config(agent).micro_batch_size
    prompts = [typical_prompt(cfg, node, problems[(i // cfg.run.group_size) % len(problems)], tok, filler=str(i))
               for i in range(micro)]
    return prefill_positions(prompts) / len(prompts)


def estimate_run_s(cfg: RunConfig) -> float | None:
    """Seconds the run's steps should take on an otherwise idle 2-core machine; None for an unpriced model."""
    if any(spec.model not in COSTS for spec in cfg.agents.values()):
        return None
    total = 0.0
    problems = load_problems(cfg.data)[:8]  # generated once: a reasoning-gym dataset costs seconds
    episodes = cfg.run.queries_per_step * cfg.run.group_size
    for node in cfg.graph.nodes:
        spec = cfg.agents[node.agent]
        costs = COSTS[spec.model]
        new, prompt = spec.sampling.max_new_tokens, prompt_positions(cfg, node.name, problems)
        trained = TRAINED_SHARE if cfg.trainer_config(node.agent).dynamic_sampling else 1.0
        per_sample = (new * costs.decode_s + prompt * costs.prefill_s
                      + trained * (costs.sample_s + (prompt + new) * costs.train_s))
        total += episodes * expected_runs(cfg, node.name) * per_sample
    for spec in cfg.agents.values():
        costs = COSTS[spec.model]
        total += costs.update_s + (costs.snapshot_s / cfg.run.snapshot_every if cfg.run.save_state else 0.0)
    return PACE * cfg.run.steps * total / max(cfg.cluster.n_workers, 1)


def describe_estimate(cfg: RunConfig) -> str:
    """One line for the console, e.g. ``"30 steps per agent: about 25 minutes on 2 workers ..."``."""
    seconds = estimate_run_s(cfg)
    if seconds is None:
        return f"{cfg.run.steps} steps per agent (no time estimate for these models)"
    minutes = f"about {seconds / 60:.0f} minutes" if seconds >= 90 else f"about {seconds:.0f} seconds"
    return (f"{cfg.run.steps} steps per agent: {minutes} on {cfg.cluster.n_workers} workers, plus a minute "
            "to start (an estimate from costs measured on 2 idle cores; a loaded machine is slower)")
