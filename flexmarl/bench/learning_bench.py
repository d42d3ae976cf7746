"""`flexmarl bench learning`: does training make the default solver better on held-out problems?

The bench scores the base weights of the solver -> verifier team on held-out problems, trains the team for a
fixed budget, and scores the trained weights on the same problems. Scoring is greedy and batched, with each
agent's ``max_new_tokens`` from the config (the code of ``flexmarl.evaluate``, which the evaluate flow uses
too). Training itself is passed in as a callable, so this module stays free of Prefect; the command line
passes the ``flexmarl-train`` flow.

Data. When the GSM8K files are present (``../shared/data/gsm8k`` next to the repository), the team trains on
a subset of GSM8K *train* and is scored on the first ``n_eval`` problems of GSM8K *test*. It does not train on
the preset's ``gsm_symbolic`` data then: reasoning-gym generates those problems from templates of GSM8K test
problems ("Emily can peel 6 shrimp a minute and saute 30 shrimp in 10 minutes...", test line 990), so
training on them would leak the test set into training. Without the files, the team trains on the preset's
reasoning-gym data and is scored on the same generator under a fixed other seed.

The budget (``BUDGET``) is what differs from the ``default`` preset, each line with its reason; the numbers
behind them are in docs/performance.md ("Learning").
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from flexmarl.cluster.local import connect, open_cluster
from flexmarl.config import RunConfig, dump_config, load_config
from flexmarl.evaluate import Answer, answer_node, held_out_tasks, latest_checkpoint
from flexmarl.models.loading import resolve_model
from flexmarl.workloads.datasets import TaskItem

# The GSM8K files of the project machine, beside the repository (never copied into it).
GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"

# What the bench changes in the preset, sized so that the default bench takes about an hour on 2 CPU cores
# when it has them to itself (measurements in docs/performance.md, "Learning"). The base solver rarely
# answers a GSM8K problem right, and a GRPO group teaches only when its rewards differ, so every choice
# here aims at groups that hold both a right and a wrong answer, and at as many steps of them as an hour
# holds.
BUDGET: dict[str, str] = {
    # a step of 32 solver and 32 verifier samples costs about 340 CPU-seconds of the two workers (about
    # 3.5 minutes on two cores); 12 of them plus scoring 128 problems twice make about an hour
    "train.steps": "12",
    "train.queries_per_step": "4",
    # 8 answers per problem: at a hit rate of about 5%, a third of the groups hold a right answer (with
    # the preset's 4, a fifth)
    "train.group_size": "8",
    # 10x the preset's 1e-6: Adam moves each weight by about lr per step, and 12 steps at 1e-6 are too
    # small a change to turn a greedy answer
    "training.lr": "1.0e-5",
    # the score is greedy: sampling at 0.7 keeps the trained samples nearer the greedy answers than the
    # preset's 1.0, whose samples of a 135M model stray further (not measured here)
    "agents.solver.sampling.temperature": "0.7",
    # one micro-batch per GRPO group (the preset's 2 would make 16 commits and 16 small passes a step)
    "training.micro_batch_size": "8",
}
N_EVAL = 128
"""Held-out problems scored, for the base and again for the trained team."""
MAX_SOLUTION_STEPS = 1
"""GSM8K train problems kept for training: those whose reference solution has at most this many
calculations (``<<a*b=c>>`` annotations), 499 of 7,473. The base solver gets some of them right (4 of 64
answers sampled at temperature 0.7 in a probe); on all problems it is right more rarely still."""
EVAL_BATCH_SIZE = 16


@dataclass(frozen=True)
class LearningPlan:
    """What the bench trains and where it scores, decided before anything runs."""

    config: RunConfig  # the training run's config (preset + BUDGET + the user's overrides)
    solver: str  # the graph's root node
    verifier: str  # the node that judges the solver's answer
    eval_tasks: list[TaskItem]
    train_data: str  # where the training tasks come from, in words
    eval_data: str  # where the held-out tasks come from, in words
    eval_batch_size: int = EVAL_BATCH_SIZE  # tasks per greedy generation batch when scoring


@dataclass(frozen=True)
class TeamScore:
    """One team's greedy answers to the held-out tasks (solver, then the verifier judging that answer)."""

    solver: list[Answer]
    verifier: list[Answer]

    @property
    def accuracy(self) -> float:
        return sum(a.reward for a in self.solver) / max(len(self.solver), 1)

    @property
    def truths(self) -> list[bool]:
        return [a.reward == 1.0 for a in self.solver]

    @property
    def verdicts(self) -> list[str | None]:
        return [a.parsed for a in self.verifier]


def verifier_agreement(verdicts: Sequence[str | None], truths: Sequence[bool]) -> float:
    """How often the verifier's verdict agrees with the true correctness of the solver's answer.

    A verdict agrees when it is ``"correct"`` on a right answer or ``"incorrect"`` on a wrong one; a verdict
    the parser could not read (``None``) disagrees. This is the mean of the verifier's own reward
    (``verdict_matches``). A verifier that always says "incorrect" scores the share of wrong answers, so
    read it beside ``1 - accuracy``.

    Example:
        >>> verifier_agreement(["correct", "incorrect", None, "correct"], [True, True, False, False])
        0.25
    """
    if len(verdicts) != len(truths):
        raise ValueError(f"{len(verdicts)} verdicts for {len(truths)} answers")
    if not truths:
        return 0.0
    return sum(v is not None and (v == "correct") == t for v, t in zip(verdicts, truths, strict=True)) / len(truths)


def gsm8k_train_subset(train_file: Path, max_solution_steps: int) -> list[dict]:
    """The GSM8K train problems whose reference solution has at most ``max_solution_steps`` calculations."""
    rows = [json.loads(line) for line in train_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if r["answer"].count("<<") <= max_solution_steps]


def team_nodes(cfg: RunConfig) -> tuple[str, str]:
    """The solver (the one root) and the verifier (its one child) of a two-node chain.

    Raises:
        ValueError: the graph is not a solver -> verifier chain.
    """
    graph = cfg.graph.expanded
    nodes = graph.order()
    if len(nodes) != 2 or graph.parents(nodes[1]) != [nodes[0]]:
        raise ValueError(
            f"bench learning scores a two-node solver -> verifier graph; this one has nodes {nodes}. "
            "Use the default or tiny preset"
        )
    return nodes[0], nodes[1]


def plan_learning(
    out_dir: Path, *, preset: str = "default", steps: int | None = None, n_eval: int = N_EVAL,
    overrides: Sequence[str] = (), data_dir: Path = GSM8K_DIR, max_solution_steps: int = MAX_SOLUTION_STEPS,
    eval_batch_size: int = EVAL_BATCH_SIZE,
) -> LearningPlan:
    """Resolve the training config and the held-out tasks; writes the GSM8K training subset to ``out_dir``.

    Args:
        out_dir: the bench's output directory.
        preset: the workload (``default``; ``tiny`` for tests).
        steps: optimizer steps per agent (default: ``BUDGET``).
        n_eval: held-out problems to score.
        overrides: ``dotted.key=value`` settings applied after ``BUDGET``.
        data_dir: a directory with GSM8K ``train.jsonl`` and ``test.jsonl``; without them, reasoning-gym data.
        max_solution_steps: see ``MAX_SOLUTION_STEPS``.
        eval_batch_size: tasks per greedy generation batch when scoring.

    Raises:
        ConfigError: a bad override. ValueError: no training problem is left, or the graph is no team.
    """
    if n_eval < 1 or eval_batch_size < 1:
        raise ValueError(f"n_eval and eval_batch_size must be at least 1, got {n_eval} and {eval_batch_size}")
    extra = [f"{k}={v}" for k, v in BUDGET.items()]
    if steps is not None:
        extra.append(f"train.steps={steps}")
    train_file, test_file = data_dir / "train.jsonl", data_dir / "test.jsonl"
    if train_file.is_file() and test_file.is_file():
        subset = gsm8k_train_subset(train_file, max_solution_steps)
        if not subset:
            raise ValueError(f"no GSM8K train problem has at most {max_solution_steps} calculations; raise it")
        out_dir.mkdir(parents=True, exist_ok=True)
        subset_file = out_dir / "train_tasks.jsonl"
        subset_file.write_text("".join(json.dumps(r) + "\n" for r in subset), encoding="utf-8")
        extra += [f"data.path={subset_file.resolve()}", f"data.size={len(subset)}"]
        train_data = f"{train_file}: {len(subset)} problems with <= {max_solution_steps} calculations"
        cfg = load_config(preset=preset, overrides=[*extra, *overrides])
        eval_tasks = held_out_tasks(cfg.data, n_eval, path=test_file)
        eval_data = f"{test_file}: the first {len(eval_tasks)} problems"
    else:
        cfg = load_config(preset=preset, overrides=[*extra, *overrides])
        eval_tasks = held_out_tasks(cfg.data, n_eval)
        train_data = f"reasoning-gym {cfg.data.dataset} (seed {cfg.data.seed}, {cfg.data.size} tasks)"
        eval_data = f"reasoning-gym {cfg.data.dataset} under another seed: {len(eval_tasks)} tasks"
    solver, verifier = team_nodes(cfg)
    return LearningPlan(cfg, solver, verifier, eval_tasks, train_data, eval_data, eval_batch_size)


def score_team(
    client, cfg: RunConfig, nodes: tuple[str, str], model_dirs: tuple[Path, Path], tasks: list[TaskItem], *,
    batch_size: int = EVAL_BATCH_SIZE,
) -> TeamScore:
    """The solver's greedy answers, then the verifier's greedy verdicts on them, spread over the workers.

    Each worker answers a contiguous run of whole batches, so the answers do not depend on the number of
    workers: the same weights and tasks give the same answers.
    """
    solver, verifier = nodes
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    n_batches = math.ceil(len(tasks) / batch_size)
    per_worker = math.ceil(n_batches / len(workers)) * batch_size
    shares = [(w, slice(i * per_worker, (i + 1) * per_worker)) for i, w in enumerate(workers)]
    shares = [(w, s) for w, s in shares if tasks[s]]

    def answer(node: str, model_dir: Path, parents: list[dict[str, Answer]] | None) -> list[Answer]:
        futures = [
            client.submit(answer_node, cfg, node, str(model_dir), tasks[s], parents=parents[s] if parents else None,
                          batch_size=batch_size, workers=[w], allow_other_workers=False, pure=False)
            for w, s in shares
        ]
        return [a for f in futures for a in f.result()]

    solver_answers = answer(solver, model_dirs[0], None)
    verdicts = answer(verifier, model_dirs[1], [{solver: a} for a in solver_answers])
    return TeamScore(solver_answers, verdicts)


TrainFn = Callable[[Path, Path, str], dict]
"""Runs training: (config file, run directory, Dask scheduler address) -> the run's report (report.json)."""


def run_learning_bench(
    plan: LearningPlan, out_dir: Path, *, train: TrainFn, log: Callable[[str], None] = print,
) -> dict:
    """Score the base team, train it with ``train``, score the trained team; write ``out_dir/learning.json``.

    Returns:
        The report: ``base_accuracy`` and ``trained_accuracy`` (the solver's mean reward on the held-out
        tasks), ``n_eval``, ``steps`` (optimizer steps the solver took), ``wall_s`` (the whole bench),
        ``verifier_agreement`` (``{"base", "trained", "n", "if_always_incorrect", "said_correct"}``: each
        team's verifier judging its own solver's answers, see ``verifier_agreement``), plus the solver's
        ``gained``/``lost`` problems, timings, data sources and the training reward by step.
        ``out_dir/eval_answers.jsonl`` holds every held-out answer and verdict, base and trained.
    """
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, nodes, tasks = plan.config, (plan.solver, plan.verifier), plan.eval_tasks
    agents = tuple(cfg.graph.expanded.node(n).agent for n in nodes)
    config_file = out_dir / "train_config.yaml"
    config_file.write_text(dump_config(cfg))
    run_dir = out_dir / "run"
    with open_cluster(cfg.cluster) as address:
        client = connect(address, timeout_s=cfg.cluster.connect_timeout_s, n_workers=cfg.cluster.n_workers)
        try:
            base_dirs = tuple(resolve_model(cfg.agents[a].model, seed=cfg.train.seed) for a in agents)
            log(f"scoring the base team on {len(tasks)} held-out tasks ({plan.eval_data})")
            t = time.perf_counter()
            base = score_team(client, cfg, nodes, base_dirs, tasks, batch_size=plan.eval_batch_size)
            base_eval_s = time.perf_counter() - t
            log(f"base: solver accuracy {base.accuracy:.3f} ({base_eval_s:.0f} s); training {cfg.train.steps} steps")
            t = time.perf_counter()
            train_report = train(config_file, run_dir, address)
            train_s = time.perf_counter() - t
            trained_dirs = tuple(latest_checkpoint(run_dir, a) for a in agents)
            if None in trained_dirs:
                raise RuntimeError(f"the training run in {run_dir} saved no checkpoint of {agents}")
            log(f"trained in {train_s:.0f} s; scoring the trained team")
            t = time.perf_counter()
            trained = score_team(client, cfg, nodes, trained_dirs, tasks,  # type: ignore[arg-type]
                                 batch_size=plan.eval_batch_size)
            trained_eval_s = time.perf_counter() - t
        finally:
            client.close()

    with (out_dir / "eval_answers.jsonl").open("w", encoding="utf-8") as fh:
        for i, task in enumerate(tasks):
            fh.write(json.dumps({
                "input_id": task.input_id, "question": task.fields.get("question", ""), "answer": task.answer,
                "base": {"solver": asdict(base.solver[i]), "verifier": asdict(base.verifier[i])},
                "trained": {"solver": asdict(trained.solver[i]), "verifier": asdict(trained.verifier[i])},
            }) + "\n")
    pairs = list(zip(base.truths, trained.truths, strict=True))
    solver_agent = agents[0]
    report = {
        "base_accuracy": base.accuracy,
        "trained_accuracy": trained.accuracy,
        "n_eval": len(tasks),
        "steps": train_report["agents"][solver_agent]["policy_version"],
        "wall_s": time.perf_counter() - t0,
        "verifier_agreement": {
            "base": verifier_agreement(base.verdicts, base.truths),
            "trained": verifier_agreement(trained.verdicts, trained.truths),
            "n": len(tasks),
            # what a verifier that always says "incorrect" would score
            "if_always_incorrect": {"base": 1 - base.accuracy, "trained": 1 - trained.accuracy},
            "said_correct": {s: sum(v == "correct" for v in team.verdicts) / len(tasks)
                             for s, team in (("base", base), ("trained", trained))},
        },
        # held-out problems the trained solver got right and the base did not, and the reverse
        "gained": sum(t and not b for b, t in pairs),
        "lost": sum(b and not t for b, t in pairs),
        "parsed_fraction": {s: sum(a.parsed is not None for a in team.solver) / len(tasks)
                            for s, team in (("base", base), ("trained", trained))},
        "train_reward_by_step": {a: r["mean_reward"] for a, r in train_report["agents"].items()},
        "timings_s": {"base_eval": base_eval_s, "train": train_s, "trained_eval": trained_eval_s},
        "train_data": plan.train_data,
        "eval_data": plan.eval_data,
        "model_dirs": {"base": [str(d) for d in base_dirs], "trained": [str(d) for d in trained_dirs]},
        "run_dir": str(run_dir),
    }
    (out_dir / "learning.json").write_text(json.dumps(report, indent=2))
    return report
