"""The training flow's tasks share no memory: under a process pool, where the engines, the pipeline and the
report tasks run in processes of their own, a run trains and shows each update as it does under threads
(the pipeline task runs its update task runs in its own process, whatever the flow's task runner)."""

from __future__ import annotations

from pathlib import Path

from prefect.task_runners import ProcessPoolTaskRunner

from tests.flows.test_prefect_view import task_runs


def test_the_flow_trains_with_its_tasks_in_other_processes(prefect_api, tmp_path: Path) -> None:
    from flows.train import train_run

    steps = 2
    runner = ProcessPoolTaskRunner(max_workers=2)
    state = train_run.with_options(task_runner=runner)(
        preset="tiny", steps=steps, run_dir=str(tmp_path / "run"), overrides=["run.queries_per_step=2"],
        return_state=True,
    )
    report = state.result()
    agents = sorted(report["agents"])
    assert {a: report["agents"][a]["policy_version"] for a in agents} == {a: steps for a in agents}
    runs = task_runs(state.state_details.flow_run_id, expected=steps * len(agents))
    assert sorted(runs) == sorted(f"update-{a}-v{v}" for a in agents for v in range(1, steps + 1))
    assert all(r.state.is_completed() for r in runs.values()), {n: r.state for n, r in runs.items()}
    assert (tmp_path / "run" / "timeline.json").exists()
