"""`flexmarl bench learning` on the tiny preset: the real train flow, a real Dask cluster, real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl.bench.learning_bench import plan_learning, run_learning_bench, verifier_figures, wilson_interval
from flexmarl.evaluate import answer_node
from flows.cli_bench import train_with_flow


def test_learning_bench_tiny_writes_the_report_and_scores_reproducibly(prefect_api, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # 3 problems in batches of 2 on 2 workers: one scores a whole batch, the other a partial one
    plan = plan_learning(out, preset="tiny", steps=1, n_eval=3, eval_batch_size=2, gsm8k_n=2,
                         overrides=["run.queries_per_step=2"])
    logged: list[str] = []
    report = run_learning_bench(plan, out, train=train_with_flow, log=logged.append)

    assert json.loads((out / "learning.json").read_text()) == report
    assert report["n_eval"] == 3 and report["steps"] == 1
    for key in ("base_accuracy", "trained_accuracy", "wall_s"):
        assert isinstance(report[key], float)
    assert 0.0 <= report["base_accuracy"] <= 1.0 and 0.0 <= report["trained_accuracy"] <= 1.0
    assert report["wall_s"] >= sum(report["timings_s"].values())
    assert set(report["verifier"]) == {"base", "trained"}
    assert (out / "learning.png").stat().st_size > 0
    if plan.gsm8k_problems:  # the GSM8K files are on this machine: two problems, solver only
        assert report["gsm8k"]["base"]["n"] == report["gsm8k"]["trained"]["n"] == 2
    assert report["model_dirs"]["trained"] == [str(out / "run" / "checkpoints" / a / "v1")
                                               for a in ("solver", "verifier")]

    # every answer is in eval_answers.jsonl, and the report's numbers follow from them
    rows = [json.loads(line) for line in (out / "eval_answers.jsonl").read_text().splitlines()]
    assert [r["input_id"] for r in rows] == [t.input_id for t in plan.eval_problems]
    for stage in ("base", "trained"):
        truths = [r[stage]["solver"]["reward"] == 1.0 for r in rows]
        assert report[f"{stage}_accuracy"] == pytest.approx(sum(truths) / 3)
        assert report[f"{stage}_interval"] == list(wilson_interval(sum(truths), 3))
        verdicts = [r[stage]["verifier"]["parsed"] for r in rows]
        assert report["verifier"][stage] == verifier_figures(verdicts, truths)

    # scoring the trained weights again, in one process, gives the very answers the two workers gave
    trained_solver = Path(report["model_dirs"]["trained"][0])
    again = answer_node(plan.config, "solver", trained_solver, plan.eval_problems, batch_size=2)
    assert [a.response for a in again] == [r["trained"]["solver"]["response"] for r in rows]
