"""How long a run will take, said before it starts: the config's token counts priced at measured costs.

The costs are seconds per sample-token on one worker of this project's 2-core machine (one torch thread per
worker), from measurements there: SmolLM2-135M generates 16 x 64 tokens in about 15 s and trains on 16 x 128
tokens in about 40 s (27% less since only response positions reach the vocabulary projection), an update
(optimizer step, weight sync) costs seconds and so does each state written (1.7 GB every
``run.snapshot_every`` updates: a host copy of about 2 s on the worker, the write itself in the background).
Prompt tokens count as the rollout's prefill and the trainer run them: a micro-batch's shared head and a group's
repeated prompt once (``prompt_positions``, after ``models/prefix.py``); a prefill position costs a forward pass,
about a third of a trained one. With answers of a few tokens, as in the default preset, prompts are most of the
work. The tiny models cost little but the pipeline's per-step overhead. Other models have no price, and get no
estimate. It is a rough guide for an idle machine (a loaded one is slower: the copy preset, estimated at 3
minutes, took 10 on a machine running two other trainings); the run's own progress lines give the measured pace
once an update is done.
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
    train_s: float  # one token (prompt or response) of one sample through forward and backward
    update_s: float  # per optimizer step: the step and the weight sync
    snapshot_s: float  # per training state written (run.snapshot_every)


COSTS = {
    "smollm2-135m-instruct": TokenCosts(decode_s=0.015, train_s=0.012, update_s=5.0, snapshot_s=2.0),
    "tiny": TokenCosts(decode_s=2e-4, train_s=5e-5, update_s=1.5, snapshot_s=0.0),
    "tiny-large": TokenCosts(decode_s=4e-4, train_s=2e-4, update_s=1.5, snapshot_s=0.0),
}
FORWARD_SHARE = 1 / 3  # of a trained position's cost: the forward pass alone, as the rollout's prefill runs it
LATER_TURN_SHARE = 0.3
"""The share of episodes that run a loop's later turns, where an early stop may skip them: the default team's
verifier rejected 26% of its first answers over 40 steps of `bench learning` (docs/performance.md, "Learning")."""


def expected_nodes(cfg: RunConfig, agent: str) -> float:
    """The agent's nodes an episode runs on average: each node an early stop may skip counts
    ``LATER_TURN_SHARE``."""
    skippable = {n for rule in cfg.graph.expanded.stop_rules() for n in rule.skip}
    return sum(LATER_TURN_SHARE if n in skippable else 1.0 for n in cfg.nodes_of(agent))


def agent_tokenizer(cfg: RunConfig, agent: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``agent``'s model (loaded once per estimate: it takes a fraction of a second)."""
    return load_tokenizer(Path(resolve_model(cfg.agents[agent].model, seed=cfg.run.seed)))


def typical_prompt(cfg: RunConfig, agent: str, problem: Problem, tok: PreTrainedTokenizerBase, filler: str = "x"
                   ) -> list[int]:
    """The token ids of a prompt of ``agent``: its template on ``problem``, each parent's output a full
    ``max_new_tokens`` of ``filler`` words."""
    spec = cfg.agents[agent]
    graph = cfg.graph.expanded
    node = next(n for n in cfg.nodes_of(agent))
    parents = {p: f"{filler} " * cfg.agents[graph.node(p).agent].sampling.max_new_tokens for p in graph.parents(node)}
    return render_prompt(tok, spec.prompt, spec.system, {**problem.fields, **graph.render_fields(node, parents)})


def prompt_tokens(cfg: RunConfig, agent: str, problem: Problem) -> int:
    """Tokens of a typical prompt of ``agent`` (``typical_prompt``)."""
    return len(typical_prompt(cfg, agent, problem, agent_tokenizer(cfg, agent)))


def prompt_positions(cfg: RunConfig, agent: str, problems: list[Problem]) -> float:
    """Prompt positions one sample of ``agent`` costs when a micro-batch's prompts run through
    ``prefix.prefill``: their common head once, each distinct prompt's rest once. A group shares its problem;
    a node with parents quotes their answers, so its prompts differ (filler answers of ``max_new_tokens``
    stand in, a different filler per sample)."""
    tok, micro = agent_tokenizer(cfg, agent), cfg.trainer_config(agent).micro_batch_size
    prompts = [typical_prompt(cfg, agent, problems[(i // cfg.run.group_size) % len(problems)], tok, filler=str(i))
               for i in range(micro)]
    return prefill_positions(prompts) / len(prompts)


def estimate_run_s(cfg: RunConfig) -> float | None:
    """Seconds the run's steps should take on an otherwise idle 2-core machine; None for an unpriced model."""
    total = 0.0
    problems = load_problems(cfg.data)[:8]  # generated once: a reasoning-gym dataset costs seconds
    for agent, spec in cfg.agents.items():
        costs = COSTS.get(spec.model)
        if costs is None:
            return None
        new, prompt = spec.sampling.max_new_tokens, prompt_positions(cfg, agent, problems)
        per_sample = new * costs.decode_s + prompt * FORWARD_SHARE * costs.train_s + (prompt + new) * costs.train_s
        snapshots = costs.snapshot_s / cfg.run.snapshot_every if cfg.run.save_state else 0.0
        samples = cfg.run.queries_per_step * cfg.run.group_size * expected_nodes(cfg, agent)
        total += samples * per_sample + costs.update_s + snapshots
    return cfg.run.steps * total / max(cfg.cluster.n_workers, 1)


def describe_estimate(cfg: RunConfig) -> str:
    """One line for the console, e.g. ``"30 steps per agent: about 25 minutes on 2 workers ..."``."""
    seconds = estimate_run_s(cfg)
    if seconds is None:
        return f"{cfg.run.steps} steps per agent (no time estimate for these models)"
    minutes = f"about {seconds / 60:.0f} minutes" if seconds >= 90 else f"about {seconds:.0f} seconds"
    return (f"{cfg.run.steps} steps per agent: {minutes} on {cfg.cluster.n_workers} workers, plus a minute "
            "to start (an estimate from costs measured on 2 idle cores; a loaded machine is slower)")
