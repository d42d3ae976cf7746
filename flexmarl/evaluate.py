"""Score a team on held-out problems: its episodes run through the MEG and rollout code that trained it.

``run_team`` walks each problem's episode through ``EpisodeGraph`` (the rollout's own prompts, parsers, loops and
early stops) with one ``HFBackend`` per model, greedily by default; ``score_team`` spreads the problems over a
Dask cluster's workers, and ``team_figures`` turns the episodes into what a researcher reads: the team's accuracy
(its answer node's last answer), the answer node's first answer alone, each judge's verdicts against the truth
(``judge_report``: over every verdict, and over each problem's first), each agent's calls per problem, with 95%
Wilson intervals. Used by ``flexmarl evaluate`` (``flows/evaluate.py``) and ``flexmarl bench learning``.
``answer_node`` scores one node on given parent answers (a base verifier judging a trained solver's answers).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from flexmarl.cluster.local import scheduler_workers
from flexmarl.config import ConfigError, RunConfig, load_config
from flexmarl.models.loading import load_tokenizer, resolve_model
from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.episodes import Episode, EpisodeGraph, render_prompt, request_seed
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.rollout.scoring import reward_inputs
from flexmarl.run.layout import CHECKPOINTS_DIR, CONFIG_FILE
from flexmarl.workloads.datasets import DataConfig, Problem, load_problems, problem_stream
from flexmarl.workloads.registry import JUDGED_CLASS, REWARDS, parse
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


EXPRESSION = re.compile(r"\d+(?:\.\d+)?|[-+*/()]")


def expression_key(question: str) -> str:
    """The arithmetic a question asks, without its wording (``"What is 4 + 2 - 2?"`` -> ``"4+2-2"``); a question
    without arithmetic is its own key."""
    return "".join(EXPRESSION.findall(question)) or question


def disjoint_problems(candidates: Sequence[Problem], served: Sequence[Problem], n: int) -> list[Problem]:
    """The first ``n`` candidates whose expression no served problem asks, each expression at most once.

    Raises:
        ValueError: fewer than ``n`` such candidates.
    """
    seen = {expression_key(t.fields["question"]) for t in served}
    out = []
    for problem in candidates:
        key = expression_key(problem.fields["question"])
        if key not in seen:
            seen.add(key)
            out.append(problem)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} held-out problems share no expression with the training stream; "
                     f"ask for fewer, or widen data.dataset_args")


def served_problems(cfg: RunConfig) -> list[Problem]:
    """Every problem the run's training stream serves: steps x queries_per_step, in order."""
    stream = problem_stream(cfg.data)
    return [t for step in range(cfg.run.steps) for t in stream.batch(step, cfg.run.queries_per_step)]


def held_out_for_run(cfg: RunConfig, n: int, *, path: Path | None = None) -> list[Problem]:
    """``n`` held-out problems for a run: from ``path`` when given, else generated under the held-out seed (4x as
    many as needed) and kept only when no problem the run's training stream serves asks the same expression, so
    the same sum asked in other words does not count as held out either."""
    if path is not None or cfg.data.path is not None:
        return held_out_problems(cfg.data, n, path=path)
    return disjoint_problems(held_out_problems(cfg.data, 4 * n), served_problems(cfg), n)


def latest_checkpoint(run_dir: Path, agent: str) -> Path | None:
    """The agent's newest ``RUN_DIR/checkpoints/<agent>/v<N>``, or None when it has none."""
    versions = sorted((run_dir / CHECKPOINTS_DIR / agent).glob("v*"), key=lambda p: int(p.name[1:]))
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
        cfg: the run's config (the node's role gives prompt, parser and reward; its agent ``max_new_tokens``).
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
    role = cfg.role(node)
    max_new_tokens = cfg.agents[role.agent].sampling.max_new_tokens
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
                render_prompt(tok, role.prompt, role.system,
                              {**t.fields, **graph.render_fields(node, {p: a.response for p, a in got.items()})}),
                max_new_tokens, temperature, seed=i,
            )
            for i, (t, got) in enumerate(zip(chunk, inputs, strict=True), start=start)
        ]
        for problem, got, result in zip(chunk, inputs, backend.generate(requests), strict=True):
            text = tok.decode(result.response_ids, skip_special_tokens=True)
            parsed = parse(role.parser, text, next((got[p].parsed for p in parent_nodes if p in got), None))
            outputs = {**{p: a.parsed for p, a in got.items()}, node: parsed}
            reward = REWARDS[role.reward](RewardInput(node, parsed, problem, outputs, parent_nodes, (node,), text))
            answers.append(Answer(problem.input_id, text, parsed, reward))
    return answers


Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default).

    Example:
        >>> [round(x, 3) for x in wilson_interval(100, 500)]
        [0.167, 0.237]
    """
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half)))  # p inside, despite rounding


def proportion(successes: int, n: int) -> dict:
    """A share with its count and 95% Wilson interval (a list: what a JSON report reads back as)."""
    return {"correct": successes, "n": n, "accuracy": successes / n if n else 0.0,
            "interval": list(wilson_interval(successes, n))}


@dataclass(frozen=True)
class NodeRun:
    """One node of a team's episode: what it said, what its parser read, its reward, and for a judge (a node
    whose reward is in ``JUDGED_CLASS``) whether the answer it judged was right."""

    node: str
    agent: str
    response: str
    parsed: str | None
    reward: float
    judged_right: bool | None = None


@dataclass(frozen=True)
class TeamRun:
    """A problem's episode through the team's graph, its nodes in the order they ran."""

    problem: Problem
    nodes: tuple[NodeRun, ...]
    team_answer: str | None  # the parsed output of the graph's answer node, at its last instance that ran
    team_correct: bool
    first_answer_correct: bool  # the answer node's first instance, before the team changed anything


def run_team(
    cfg: RunConfig, model_dirs: Mapping[str, str | Path], problems: Sequence[Problem], *, batch_size: int = 32,
    temperature: float = 0.0, trajectory: int = 0,
) -> list[TeamRun]:
    """Run every problem's episode through the graph with each agent's weights in ``model_dirs`` and score it.

    Nodes are generated wave by wave: every ready node of one agent, in batches of ``batch_size`` problems, then
    the next; a loop's early stop skips the later turns exactly as in training. At temperature 0 (the default)
    decoding is greedy, so the same weights, problems and batch size give the same runs; above it, each node
    samples with the seed training would give group member ``trajectory`` (``request_seed``).

    Raises:
        ValueError: an agent of the graph without a model directory.
    """
    missing = sorted(set(cfg.agents) - set(model_dirs))
    if missing:
        raise ValueError(f"no model directory for agent(s) {missing}; give one per agent of the graph")
    tokenizers = {a: load_tokenizer(Path(model_dirs[a])) for a in cfg.agents}
    backends: dict[str, HFBackend] = {}  # by model directory: agents on the same weights share one
    for agent in cfg.agents:
        backends.setdefault(str(model_dirs[agent]), HFBackend(model_dirs[agent]))
    graph = EpisodeGraph(cfg, tokenizers)
    episodes = [Episode(problem, trajectory_id=trajectory, step=0) for problem in problems]
    ready = [(ep, node) for ep in episodes for node in graph.roots]
    while ready:
        agent = graph.agent_of[ready[0][1]]
        wave = [r for r in ready if graph.agent_of[r[1]] == agent]
        ready = [r for r in ready if graph.agent_of[r[1]] != agent]
        sampling = cfg.agents[agent].sampling
        backend = backends[str(model_dirs[agent])]
        for start in range(0, len(wave), batch_size):
            chunk = wave[start:start + batch_size]
            prompts = [graph.prompt(ep, node) for ep, node in chunk]
            requests = [GenerationRequest(graph.sample_id(ep, node), ids, sampling.max_new_tokens, temperature,
                                          request_seed(cfg.run.seed, graph.sample_id(ep, node)))
                        for (ep, node), ids in zip(chunk, prompts, strict=True)]
            for (ep, node), ids, result in zip(chunk, prompts, backend.generate(requests), strict=True):
                ready += [(ep, child) for child in graph.record(ep, node, ids, result)]
    return [team_run(ep, cfg) for ep in episodes]


def team_run(ep: Episode, cfg: RunConfig) -> TeamRun:
    """The finished episode as a record: each node's reward (the raw reward, before any group reweighting; 0 where
    the reward function raised, as a failed episode earns nothing in training)."""
    nodes = []
    for node, x in reward_inputs(ep, cfg).items():
        out = ep.outputs[node]
        reward_name = cfg.role(node).reward
        try:
            reward = float(REWARDS[reward_name](x))
            judged = JUDGED_CLASS[reward_name](x) if reward_name in JUDGED_CLASS else None
        except Exception:  # noqa: BLE001 - reward code may fail on odd outputs
            reward, judged = 0.0, None
        nodes.append(NodeRun(node, out.agent, out.text, out.parsed, reward, judged))
    order = cfg.graph.expanded.order()
    answers = sorted((n for n in cfg.graph.expanded.instances(cfg.graph.answer_node()) if n in ep.outputs),
                     key=order.index)
    by_node = {n.node: n for n in nodes}
    first, last = by_node[answers[0]], by_node[answers[-1]]
    return TeamRun(ep.problem, tuple(nodes), last.parsed, last.reward == 1.0, first.reward == 1.0)


def spread(client, fn, items: Sequence, *args, batch_size: int = 32) -> list:
    """``fn(*args, items_share, batch_size=batch_size)`` on each worker of the cluster, each share a contiguous
    run of whole batches of ``items`` (so the results do not depend on the number of workers), concatenated."""
    if not items:
        return []
    workers = sorted(scheduler_workers(client))
    per_worker = math.ceil(math.ceil(len(items) / batch_size) / len(workers)) * batch_size
    shares = [(w, items[i * per_worker:(i + 1) * per_worker]) for i, w in enumerate(workers)]
    futures = [client.submit(fn, *args, share, batch_size=batch_size, workers=[w], allow_other_workers=False,
                             pure=False) for w, share in shares if share]
    return [x for f in futures for x in f.result()]


def score_team(client, cfg: RunConfig, model_dirs: Mapping[str, str | Path], problems: Sequence[Problem], *,
               batch_size: int = 32, temperature: float = 0.0, trajectory: int = 0) -> list[TeamRun]:
    """``run_team`` spread over the cluster's workers."""
    return spread(client, partial(run_team, temperature=temperature, trajectory=trajectory), list(problems), cfg,
                  {a: str(d) for a, d in model_dirs.items()}, batch_size=batch_size)


@dataclass(frozen=True)
class Judgment:
    """One verdict of a judge: whether it is the problem's first (on the first answer the judge read), what it
    said, and whether the answer it judged was right."""

    first: bool
    verdict: str | None
    judged_right: bool


def judge_again(cfg: RunConfig, agent: str, model_dir: str | Path, runs: Sequence[TeamRun], *,
                batch_size: int = 32) -> list[Judgment]:
    """``agent``'s verdicts, with the weights in ``model_dir``, on the very answers its nodes judged in ``runs``
    (e.g. the base verifier on the trained solver's answers): one ``Judgment`` per judged answer.

    The agent's other nodes that ran are generated again too, in graph order, so a judge that first works the
    problem out reads its own working; the other agents' answers are the ones in ``runs``."""
    out: list[Judgment] = []
    judged_once: set[int] = set()  # the runs whose first verdict is already out (nodes go in graph order)
    order = cfg.graph.expanded.order()
    by_run = [{x.node: Answer(run.problem.input_id, x.response, x.parsed, x.reward) for x in run.nodes}
              for run in runs]
    truths = [{x.node: x.judged_right for x in run.nodes} for run in runs]
    for node in sorted(cfg.nodes_of(agent), key=order.index):
        ran = [i for i, by in enumerate(by_run) if node in by]
        if not ran:
            continue
        parents = [{p: by_run[i][p] for p in cfg.graph.expanded.parents(node) if p in by_run[i]} for i in ran]
        answers = answer_node(cfg, node, model_dir, [runs[i].problem for i in ran], parents=parents,
                              batch_size=batch_size)
        for i, answer in zip(ran, answers, strict=True):
            by_run[i][node] = answer  # this agent's later nodes read it
            if truths[i][node] is not None:
                out.append(Judgment(first=i not in judged_once, verdict=answer.parsed,
                                    judged_right=bool(truths[i][node])))
                judged_once.add(i)
    return out


def judge_figures(verdicts: Sequence[str | None], truths: Sequence[bool]) -> dict:
    """A judge's verdicts (``correct``, ``incorrect``, None: unparsed) against whether each judged answer was right.

    ``tpr``: right answers it called correct; ``tnr``: wrong answers it called incorrect; ``balanced``: their
    mean (0.5 for a constant verdict; None when a class is absent); ``unparsed``: verdicts its parser could not
    read; ``always_yes`` and ``always_no``: the agreement of the two trivial judges on the same answers.

    Example:
        >>> f = judge_figures(["correct", "incorrect", None, "incorrect"], [True, True, False, False])
        >>> f["tpr"]["accuracy"], f["tnr"]["accuracy"], f["balanced"], f["unparsed"], f["always_no"]
        (0.5, 0.5, 0.5, 0.25, 0.5)
    """
    if len(verdicts) != len(truths):
        raise ValueError(f"{len(verdicts)} verdicts for {len(truths)} answers")
    right = [v for v, t in zip(verdicts, truths, strict=True) if t]
    wrong = [v for v, t in zip(verdicts, truths, strict=True) if not t]
    tpr = proportion(sum(v == "correct" for v in right), len(right))
    tnr = proportion(sum(v == "incorrect" for v in wrong), len(wrong))
    n = max(len(truths), 1)
    return {"n": len(truths), "right_answers": len(right), "wrong_answers": len(wrong), "tpr": tpr, "tnr": tnr,
            "balanced": (tpr["accuracy"] + tnr["accuracy"]) / 2 if right and wrong else None,
            "unparsed": sum(v is None for v in verdicts) / n,
            "said_correct": sum(v == "correct" for v in verdicts) / n,
            "always_yes": len(right) / n, "always_no": len(wrong) / n}


def judge_report(judgments: Sequence[Judgment]) -> dict:
    """``judge_figures`` over every verdict, and in ``on_first_answers`` over each problem's first verdict alone.

    The first verdicts are one held-out pair (problem, proposed answer) per problem. The later ones are not
    independent of them: a loop's second turn exists because the first verdict rejected, and a judge that does not
    read the answer (a ``same_result`` verifier) repeats its verdict word for word when the solver repeats its
    answer, so over every verdict its rejections of right answers count twice.
    """
    first = [j for j in judgments if j.first]
    return {**judge_figures([j.verdict for j in judgments], [j.judged_right for j in judgments]),
            "on_first_answers": judge_figures([j.verdict for j in first], [j.judged_right for j in first])}


def team_figures(runs: Sequence[TeamRun]) -> dict:
    """What the team did on the problems: ``team`` accuracy, ``first_answer`` accuracy (the answer node alone),
    and per agent its ``calls_per_problem``, ``mean_reward`` and, for a judge, its ``judge_report``."""
    n = len(runs)
    by_agent: dict[str, list[NodeRun]] = defaultdict(list)
    judgments: dict[str, list[Judgment]] = defaultdict(list)
    for run in runs:
        judged_here: set[str] = set()  # the agents whose first verdict on this problem is counted
        for node in run.nodes:  # in the order they ran
            by_agent[node.agent].append(node)
            if node.judged_right is not None:
                judgments[node.agent].append(Judgment(node.agent not in judged_here, node.parsed, node.judged_right))
                judged_here.add(node.agent)
    agents = {}
    for agent, nodes in by_agent.items():
        figures = {"calls_per_problem": len(nodes) / max(n, 1),
                   "mean_reward": sum(x.reward for x in nodes) / len(nodes)}
        if judgments[agent]:
            figures["judge"] = judge_report(judgments[agent])
        agents[agent] = figures
    return {"n": n, "team": proportion(sum(r.team_correct for r in runs), n),
            "first_answer": proportion(sum(r.first_answer_correct for r in runs), n), "agents": agents}


def judged_again(client, cfg: RunConfig, agent: str, model_dir: Path, runs: Sequence[TeamRun], *,
                 batch_size: int = 32) -> dict:
    """``judge_report`` of ``judge_again`` spread over the cluster's workers."""
    return judge_report(spread(client, judge_again, list(runs), cfg, agent, str(model_dir), batch_size=batch_size))


def judge_agents(cfg: RunConfig) -> list[str]:
    """The agents that judge another node's answer (a node of theirs has a reward in ``JUDGED_CLASS``)."""
    return [a for a in cfg.agents if any(cfg.role(n).reward in JUDGED_CLASS for n in cfg.nodes_of(a))]


def evaluation_report(client, cfg: RunConfig, trained_dirs: Mapping[str, Path], base_dirs: Mapping[str, Path],
                      problems: Sequence[Problem], *, batch_size: int = 32) -> tuple[dict, list[TeamRun]]:
    """The trained team and the base team on ``problems``, and each base judge on the trained team's answers.

    Returns:
        The report (``trained`` and ``base``: ``team_figures``; ``base_judges``: per judge agent, the base weights'
        ``judge_report`` on the very answers the trained judge judged), and the trained team's runs.
    """
    trained = score_team(client, cfg, trained_dirs, problems, batch_size=batch_size)
    base = score_team(client, cfg, base_dirs, problems, batch_size=batch_size)
    base_judges = {a: judged_again(client, cfg, a, base_dirs[a], trained, batch_size=batch_size)
                   for a in judge_agents(cfg)}
    report = {"n": len(problems), "trained": team_figures(trained), "base": team_figures(base),
              "base_judges": base_judges,
              "model_dirs": {"trained": {a: str(d) for a, d in trained_dirs.items()},
                             "base": {a: str(d) for a, d in base_dirs.items()}}}
    return report, trained


@dataclass(frozen=True)
class EvaluationPlan:
    """What ``flexmarl evaluate`` scores, decided (and every input checked) before anything starts."""

    cfg: RunConfig
    trained_dirs: dict[str, Path]  # each agent's latest checkpoint
    base_dirs: dict[str, Path]  # each agent's starting model
    problems: list[Problem]
    source: str  # where the problems come from, in words


def plan_evaluation(run_dir: Path, n: int, *, data_path: Path | None = None) -> EvaluationPlan:
    """Check the run directory and resolve what the evaluation scores.

    Raises:
        ConfigError: no run directory, an agent without a checkpoint or with an adapter, or too few held-out
            problems. DataError: an unreadable ``data_path``.
    """
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); give a directory `flexmarl train` "
                          "wrote")
    cfg = load_config(run_dir / CONFIG_FILE)
    adapters = sorted(a for a, spec in cfg.agents.items() if spec.adapter is not None)
    if adapters:
        raise ConfigError(f"agents {adapters} train adapters, which evaluate does not load yet; export each merged "
                          f"(`flexmarl export {run_dir} AGENT OUT --merge`) and score that model")
    trained = {a: latest_checkpoint(run_dir, a) for a in cfg.agents}
    missing = sorted(a for a, d in trained.items() if d is None)
    if missing:
        raise ConfigError(f"{run_dir} has no checkpoint of {missing} (checkpoints/<agent>/v<N>): train the run "
                          f"first, or continue it with `flexmarl train --resume {run_dir}`")
    try:
        problems = held_out_for_run(cfg, n, path=data_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    source = (f"{data_path}: its first {len(problems)}" if data_path else
              f"reasoning-gym {cfg.data.dataset} under another seed: {len(problems)} problems, none asking an "
              "expression the training stream asked")
    base = {a: resolve_model(spec.model, seed=cfg.run.seed) for a, spec in cfg.agents.items()}
    return EvaluationPlan(cfg, {a: d for a, d in trained.items() if d is not None}, base, problems, source)
