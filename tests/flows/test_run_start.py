"""Starting `flexmarl train` in a run directory: the lock, a start that committed nothing, verify before resume.

The CLI runs in this process with the Prefect server and the flow replaced by stubs that record the call and
the plan the CLI hands the flow, so each test sees what the command decides before a run would start.
Processes that hold a lock are real.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flexmarl.config import load_config
from flexmarl.run.plan import Start
from flexmarl.run.prepare import prepare, prepare_run
from flexmarl.run_lock import LOCK_FILE, is_locked, run_lock
from flexmarl.run_start import check_resumable, clear_failed_start, never_committed

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import sys, time\nfrom flexmarl.run_lock import run_lock\nwith run_lock(sys.argv[1]):\n" \
       "    print('held', flush=True)\n    time.sleep(120)\n"


def bad_input_helpers():
    """tests/test_bad_input.py's committed_store (two committed steps), loaded by path."""
    spec = importlib.util.spec_from_file_location("bad_input_helpers", ROOT / "tests" / "test_bad_input.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cli(monkeypatch):
    """``cli(args)``: the result, and whether it got as far as the flow (with which arguments, and the plan
    handed to it as ``plan``)."""
    from flows import cli as cli_module
    from flexmarl.run.plan import held_plan

    reached: list[dict] = []

    @contextlib.contextmanager
    def fake_api(**settings):  # the real one's keyword settings (on_server_exit) do nothing here
        yield "http://stub/api"

    def fake_flow(**kwargs):
        reached.append({**kwargs, "plan": held_plan()})
        run_dir = kwargs["run_dir"] or kwargs["resume"]
        return {"run_id": "stub", "wall_s": 0.0, "agents": {}, "run_dir": run_dir}

    monkeypatch.setattr("flows.prefect_server.prefect_api", fake_api)
    monkeypatch.setattr("flows.train.train_run", fake_flow)
    sigterm = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli_module.signal, "signal", lambda *a: None)  # keep the test runner's handler

    def invoke(args: list[str]):
        result = CliRunner().invoke(cli_module.app, args)
        assert "Traceback" not in result.output
        return result, list(reached)

    yield invoke
    assert signal.getsignal(signal.SIGTERM) is sigterm


def holder_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def failed_start(run_dir: Path) -> None:
    """What a start that failed after laying out its directory, before its first commit, leaves."""
    prepare_run(load_config(preset="tiny"), run_dir)
    assert (run_dir / "config.yaml").exists() and (run_dir / "store" / "updates").is_dir()


def test_a_start_that_failed_before_its_first_commit_is_taken_over(cli, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    failed_start(run_dir)
    (run_dir / "notes.txt").write_text("mine")  # not the run's: stays
    assert never_committed(run_dir)
    result, reached = cli(["train", "--preset", "tiny", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert reached and reached[0]["run_dir"] == str(run_dir)
    plan = reached[0]["plan"]
    assert plan.start is Start.NEW and plan.takes_over
    assert (run_dir / "config.yaml").exists()  # planned, not done: the flow carries the plan out
    run = prepare(plan)
    assert run.took_over and (run_dir / "attempts.txt").read_text().splitlines() == [run.run_id]  # the old one's gone
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_a_run_with_a_commit_is_never_taken_over(cli, tmp_path: Path) -> None:
    _, run_dir, store = bad_input_helpers().committed_store(tmp_path)
    assert not never_committed(run_dir) and not clear_failed_start(run_dir)
    def files() -> list[Path]:  # the empty lock file stays once made (every `flexmarl train` run has one)
        return sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.name != LOCK_FILE)

    before = files()
    result, reached = cli(["train", "--preset", "tiny", "--run-dir", str(run_dir)])
    assert result.exit_code == 2 and "already holds a run" in result.stderr and not reached
    assert files() == before


def test_a_resume_with_a_changed_setting_of_a_run_that_committed_nothing_says_start_again(cli, tmp_path) -> None:
    run_dir = tmp_path / "run"
    failed_start(run_dir)
    result, reached = cli(["train", "--resume", str(run_dir), "--set", "data.dataset=gsm_symbolic"])
    assert result.exit_code == 2 and not reached
    assert "cannot change data.dataset" in result.stderr and "start it again in place" in result.stderr


def test_a_second_run_and_a_resume_of_a_live_run_are_refused_naming_the_holder(cli, tmp_path: Path) -> None:
    _, run_dir, _ = bad_input_helpers().committed_store(tmp_path)
    (run_dir / "report.json").write_text('{"samples_generated": 32}')
    holder = holder_process(run_dir)
    try:
        for args in (["train", "--resume", str(run_dir)], ["train", "--preset", "tiny", "--run-dir", str(run_dir)]):
            result, reached = cli(args)
            assert result.exit_code == 2 and not reached, result.output
            assert f"is in use by process {holder.pid}" in result.stderr and f"kill {holder.pid}" in result.stderr
        assert json.loads((run_dir / "report.json").read_text()) == {"samples_generated": 32}
    finally:
        holder.kill()
        holder.wait()
    result, reached = cli(["train", "--resume", str(run_dir)])  # the lock ended with its holder
    assert result.exit_code == 0 and reached, result.output


def test_the_lock_ends_with_its_process_even_after_kill_9(tmp_path: Path) -> None:
    holder = holder_process(tmp_path / "run")
    assert is_locked(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert not is_locked(tmp_path / "run")
    with run_lock(tmp_path / "run"):
        assert is_locked(tmp_path / "run")


def test_the_lock_is_reentrant_in_a_process_and_a_refused_new_directory_goes_as_it_came(tmp_path: Path) -> None:
    run_dir = tmp_path / "new"
    with pytest.raises(RuntimeError), run_lock(run_dir):
        with run_lock(run_dir):  # the CLI holds it, then its flow takes it again
            assert (run_dir / LOCK_FILE).exists()
        raise RuntimeError("refused under the lock")
    assert not run_dir.exists()


def test_resume_runs_verify_first_and_a_healthy_store_passes(cli, tmp_path: Path) -> None:
    cfg, run_dir, store = bad_input_helpers().committed_store(tmp_path)
    check_resumable(cfg, run_dir)  # no false refusal
    result, reached = cli(["train", "--resume", str(run_dir)])
    assert result.exit_code == 0 and reached
    # a duplicate row, written behind the store's back: verify fails, so the resume is refused
    from deltalake import write_deltalake

    table = store.table_uri("samples/solver")
    write_deltalake(table, store.read("samples/solver").slice(0, 1), mode="append")
    result, reached = cli(["train", "--resume", str(run_dir)])
    assert result.exit_code == 2 and len(reached) == 1
    assert "its store fails verify: duplicate in samples/solver" in result.stderr


def test_a_flow_started_from_a_deployment_takes_the_lock_too(prefect_api, tmp_path: Path) -> None:
    from flexmarl.run_lock import RunLockError
    from flows.train import train_run

    holder = holder_process(tmp_path / "run")
    try:
        with pytest.raises(RunLockError, match=f"in use by process {holder.pid}"):
            train_run(preset="tiny", run_dir=str(tmp_path / "run"))
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run wrote anything


def test_a_run_is_planned_once_in_its_block_and_a_retry_again(tmp_path: Path, monkeypatch) -> None:
    from dataclasses import replace

    import flexmarl.run.plan as plan_module
    from flexmarl.run.plan import RunRequest, locked_plan

    planned, plan_run = [], plan_module.plan_run
    monkeypatch.setattr(plan_module, "plan_run", lambda request: planned.append(request) or plan_run(request))
    request = RunRequest(str(tmp_path / "run"), preset="tiny")
    with locked_plan(request) as plan:  # `flexmarl train`
        with locked_plan(request) as again:  # the flow it runs: nothing checked twice
            assert again is plan
        with locked_plan(replace(request, retry_of="a-flow-run-id")) as retry:  # a later attempt: planned again
            assert retry is not plan and retry.start is Start.NEW  # that flow run started no run here
    assert planned == [request, replace(request, retry_of="a-flow-run-id")]
