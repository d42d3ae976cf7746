"""The evaluate flow: run a trained team on held-out problems through its own graph, beside its base team.

    flexmarl evaluate runs/default
    prefect deployment run 'flexmarl-evaluate/latest' --param run_dir=runs/default

Writes ``RUN_DIR/evaluation.json`` (``flexmarl.evaluate.evaluation_report``: the team's and the answer node's
accuracy, each judge's verdicts against the truth beside the base judge's and the trivial judges', calls per
problem, with 95% Wilson intervals) and ``RUN_DIR/evaluation_runs.jsonl`` (every node of every episode).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flexmarl.cluster.local import connect, open_cluster
from flexmarl.evaluate import plan_evaluation
from flexmarl.run.layout import EVALUATION_FILE, EVALUATION_RUNS_FILE
from tasks.evaluate import evaluate_team


@flow(name="flexmarl-evaluate")
def evaluate_run(run_dir: str, n: int = 500, data_path: str | None = None, batch_size: int = 32,
                 dask_address: str | None = None) -> dict:
    """Score the team of the run in ``run_dir`` (its latest checkpoints) and its base team on ``n`` held-out
    problems, greedily.

    Args:
        run_dir: a run directory (its config.yaml and checkpoints/ are read, evaluation.json is written).
        n: held-out problems: the run's reasoning-gym dataset under another seed, none asking an expression the
            training stream asked; or the first ``n`` of ``data_path``.
        data_path: a GSM8K-style JSONL file of held-out problems; required when the run trained on a file.
        batch_size: problems per greedy generation batch.
        dask_address: an existing Dask scheduler (default: a LocalCluster of the run config's workers; the
            cluster the run trained on, often gone by now, is not reused).
    """
    path = Path(run_dir).resolve()
    plan = plan_evaluation(path, n, data_path=Path(data_path) if data_path else None)
    cfg = plan.cfg
    cluster = cfg.cluster.model_copy(update={"address": dask_address})
    with open_cluster(cluster) as address:
        client = connect(address, timeout_s=cluster.connect_timeout_s, n_workers=cluster.n_workers)
        try:
            report, runs = evaluate_team(client, cfg, plan.trained_dirs, plan.base_dirs, plan.problems,
                                         batch_size=batch_size)
        finally:
            client.close()
    report["problems"] = plan.source
    (path / EVALUATION_FILE).write_text(json.dumps(report, indent=2))
    with (path / EVALUATION_RUNS_FILE).open("w", encoding="utf-8") as fh:
        for run in runs:
            fh.write(json.dumps(asdict(run)) + "\n")
    rows = evaluation_rows(report)
    create_table_artifact(rows, key="evaluation", description=f"Held-out evaluation of {path.name}")
    for row in rows:
        get_run_logger().info("%s", row)
    return report


def number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def share(p: dict) -> str:
    """A ``proportion`` as text: its accuracy and 95% interval."""
    lo, hi = p["interval"]
    return f"{p['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def evaluation_rows(report: dict) -> list[dict]:
    """The report as table rows: the team, then each agent, base beside trained."""
    rows = [{"what": "team answer", "base": share(report["base"]["team"]), "trained": share(report["trained"]["team"])},
            {"what": "first answer (answer node alone)", "base": share(report["base"]["first_answer"]),
             "trained": share(report["trained"]["first_answer"])}]
    for agent, figures in report["trained"]["agents"].items():
        base = report["base"]["agents"].get(agent, {})
        rows.append({"what": f"{agent}: calls per problem", "base": f"{base.get('calls_per_problem', 0):.2f}",
                     "trained": f"{figures['calls_per_problem']:.2f}"})
        if "judge" in figures:
            for which, mine, theirs in (
                    ("first answers", figures["judge"]["on_first_answers"],
                     report["base_judges"][agent]["on_first_answers"]),
                    ("every answer", figures["judge"], report["base_judges"][agent])):
                for key in ("tpr", "tnr"):
                    rows.append({"what": f"{agent} on the trained {which}: {key}", "base": share(theirs[key]),
                                 "trained": share(mine[key])})
                for key in ("balanced", "unparsed"):
                    rows.append({"what": f"{agent} on the trained {which}: {key}", "base": number(theirs[key]),
                                 "trained": number(mine[key])})
    return rows
