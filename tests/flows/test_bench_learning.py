"""`flexmarl bench learning` on the tiny preset: the real train flow, a real Dask cluster, real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from flexmarl.bench.learning_bench import plan_learning, run_learning_bench
from flexmarl.evaluate import proportion, run_team
from flows.cli_bench import train_with_flow


def test_learning_bench_tiny_writes_the_report_and_scores_reproducibly(prefect_api, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # 3 problems in batches of 2 on 2 workers: one scores a whole batch, the other a partial one
    plan = plan_learning(out, preset="tiny", steps=1, n_eval=3, eval_batch_size=2, gsm8k_n=0,
                         overrides=["run.queries_per_step=2"])
    logged: list[str] = []
    report = run_learning_bench(plan, out, train=train_with_flow, log=logged.append)

    assert json.loads((out / "learning.json").read_text()) == report
    assert report["n_eval"] == 3 and report["steps"] == 1
    assert report["wall_s"] >= sum(report["timings_s"].values()) - report["timings_s"]["single"]
    assert (out / "learning.png").stat().st_size > 0
    assert report["model_dirs"]["trained"] == {a: str(out / "run" / "checkpoints" / a / "v1")
                                               for a in ("solver", "verifier")}
    # the single solver trained as many updates, on the team's samples per step
    assert report["single_queries_per_step"] * plan.config.run.group_size == report["samples"]["team"]
    assert list(report["single_train_reward_by_step"]) == ["solver"] and report["majority_k"] == 1

    # every episode is in eval_runs.jsonl, and the report's numbers follow from them
    rows = [json.loads(line) for line in (out / "eval_runs.jsonl").read_text().splitlines()]
    assert [r["trained"]["problem"]["input_id"] for r in rows] == [t.input_id for t in plan.eval_problems]
    for stage, key in (("base", "base_accuracy"), ("trained", "solver_accuracy")):
        assert report[key] == proportion(sum(r[stage]["first_answer_correct"] for r in rows), 3)
    assert report["team_accuracy"] == proportion(sum(r["trained"]["team_correct"] for r in rows), 3)
    assert report["verifier"]["trained"]["n"] == report["verifier"]["base"]["n"] == 3

    # running the trained team again, in one process, gives the very episodes the two workers ran
    dirs = report["model_dirs"]["trained"]
    again = run_team(plan.config, dirs, plan.eval_problems, batch_size=2)
    assert [[n.response for n in r.nodes] for r in again] == [[n["response"] for n in r["trained"]["nodes"]]
                                                               for r in rows]
