"""Score an agent's weights on held-out problems: greedy, batched answers, scored by the agent's own reward.

Used by the evaluate flow (``flows/evaluate.py``) and by ``flexmarl bench learning``. A root agent of the
graph (e.g. a solver) is scored alone (``evaluate_agent``); an agent that reads other nodes' outputs (e.g. a
verifier) is scored on given parent answers (``answer_node`` with ``parents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flexmarl.config import RunConfig
from flexmarl.models.loading import load_tokenizer
from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.episodes import render_prompt
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.workloads.datasets import DataConfig, Problem, load_problems
from flexmarl.workloads.registry import PARSERS, REWARDS
from flexmarl.workloads.rewards import RewardInput

# Seed offset of the held-out reasoning-gym problems: far from any training seed a config is likely to use.
HELD_OUT_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Answer:
    """One node's greedy answer to one problem, as the node's parser and reward see it."""

    input_id: str
    response: str
    parsed: str | None  # None when the agent's parser could not read the response
    reward: float


@dataclass(frozen=True)
class EvalResult:
    agent: str
    model_dir: str
    n: int
    mean_reward: float
    parsed_fraction: float  # answers the agent's parser could read
    examples: list[dict]  # the first few (question, response, parsed, reward)


def held_out_problems(data: DataConfig, n: int, *, path: Path | None = None) -> list[Problem]:
    """``n`` problems that training on ``data`` never serves.

    Args:
        data: the run's training data.
        n: how many problems.
        path: a GSM8K-style JSONL file of held-out problems (its first ``n``); default: the run's reasoning-gym
            dataset under another seed.

    Raises:
        ValueError: the run trained on a file and no other file was given (its own file is not held out).
    """
    if path is not None:
        return load_problems(DataConfig(path=path, size=n))[:n]
    if data.path is not None:
        raise ValueError(
            f"the run trained on the file {data.path}, so its own problems are not held out; "
            "give a file of held-out problems (data_path), e.g. the GSM8K test split"
        )
    return load_problems(data.model_copy(update={"seed": data.seed + HELD_OUT_SEED_OFFSET, "size": n}))[:n]


def latest_checkpoint(run_dir: Path, agent: str) -> Path | None:
    """The agent's newest ``RUN_DIR/checkpoints/<agent>/v<N>``, or None when it has none."""
    versions = sorted((run_dir / "checkpoints" / agent).glob("v*"), key=lambda p: int(p.name[1:]))
    return versions[-1] if versions else None


def answer_node(
    cfg: RunConfig, node: str, model_dir: str | Path, problems: Sequence[Problem], *,
    parents: Sequence[dict[str, Answer]] | None = None, batch_size: int = 16, temperature: float = 0.0,
) -> list[Answer]:
    """Generate ``node``'s answer to every problem with the weights in ``model_dir`` and score it.

    Problems are decoded in consecutive batches of ``batch_size``, with the agent's ``max_new_tokens``; at
    temperature 0 (the default) decoding is greedy, so the same weights, problems and batch size give the
    same answers.

    Args:
        cfg: the run's config (the node's agent gives prompt, parser, reward and ``max_new_tokens``).
        node: an expanded node of the graph (e.g. ``solver`` or ``verifier``).
        model_dir: a Hugging Face model directory (a base model or a checkpoint).
        problems: the problems to answer.
        parents: for a node that reads other nodes, one ``{parent node: its Answer}`` per problem.
        batch_size: problems per generation batch.
        temperature: sampling temperature; 0 is greedy.

    Raises:
        ValueError: a node that reads parents without ``parents``, or a length mismatch.
    """
    graph = cfg.graph.expanded
    agent = graph.node(node).agent
    spec = cfg.agents[agent]
    parent_nodes = list(graph.parents(node))
    if parent_nodes and parents is None:
        raise ValueError(f"node {node!r} reads {parent_nodes}; pass their answers as parents=")
    if parents is not None and len(parents) != len(problems):
        raise ValueError(f"{len(parents)} parent answers for {len(problems)} problems")
    tok = load_tokenizer(Path(model_dir))
    backend = HFBackend(model_dir)
    answers: list[Answer] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        inputs = [parents[i] if parents else {} for i in range(start, start + len(chunk))]
        requests = [
            GenerationRequest(
                t.input_id,
                render_prompt(tok, spec.prompt, spec.system,
                              {**t.fields, **graph.render_fields(node, {p: a.response for p, a in got.items()})}),
                spec.sampling.max_new_tokens, temperature, seed=i,
            )
            for i, (t, got) in enumerate(zip(chunk, inputs, strict=True), start=start)
        ]
        for problem, got, result in zip(chunk, inputs, backend.generate(requests), strict=True):
            text = tok.decode(result.response_ids, skip_special_tokens=True)
            parsed = PARSERS[spec.parser](text)
            outputs = {**{p: a.parsed for p, a in got.items()}, node: parsed}
            reward = REWARDS[spec.reward](RewardInput(node, parsed, problem, outputs, parent_nodes, (node,)))
            answers.append(Answer(problem.input_id, text, parsed, reward))
    return answers


def evaluate_agent(
    cfg: RunConfig, agent: str, model_dir: str | Path, problems: list[Problem], *, batch_size: int = 16,
    temperature: float = 0.0,
) -> EvalResult:
    """Generate one answer per problem (greedy by default) with a root agent and average its reward."""
    nodes = [n for n in cfg.nodes_of(agent) if not cfg.graph.expanded.parents(n)]
    if not nodes:
        raise ValueError(f"agent {agent!r} reads other nodes' outputs; evaluate a root agent of the graph")
    answers = answer_node(cfg, nodes[0], model_dir, problems, batch_size=batch_size, temperature=temperature)
    examples = [
        {"question": t.fields.get("question", ""), "response": a.response, "parsed": a.parsed, "reward": a.reward}
        for t, a in zip(problems[:5], answers, strict=False)
    ]
    n = max(len(answers), 1)
    return EvalResult(agent, str(model_dir), len(problems), sum(a.reward for a in answers) / n,
                      sum(a.parsed is not None for a in answers) / n, examples)
