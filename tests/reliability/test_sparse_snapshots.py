"""Faults between snapshots (``run.snapshot_every`` > 1): the state of a version the run did not write is
rebuilt by replaying the store's updates, mid-run (a lost trainer and its replicas) and at resume, and the
run ends exactly where an uninterrupted one does."""

from __future__ import annotations

from pathlib import Path

from flexmarl.bench.chaos_bench import WorkerFault, kill_driver, train
from flexmarl.cluster.local import connect

from .conftest import RESTART_WAIT_S
from flexmarl.run.plan import resume_config
from flexmarl.training.snapshots import SNAPSHOTS, find_snapshot
from storage.store import ExperienceStore

# 2 steps: the state is written at v2 (the last) only, so a fault in step 1 finds no state of v1
EVERY = "run.snapshot_every=3"


def written(run_dir: Path, agent: str, versions: range) -> list[int]:
    root = str(run_dir / "state" / SNAPSHOTS)
    return [v for v in versions if find_snapshot(root, agent, v)]


def test_a_worker_killed_between_snapshots_is_rebuilt_by_replay_and_the_run_is_exact(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config(EVERY)
    struck: list[str] = []  # the agent whose micro-batch the fault struck: its trainer was on that worker

    def on_submit(kind: str, agent: str, worker: str) -> None:
        fault(kind, agent, worker)
        if fault.worker is not None and not struck:
            struck.append(agent)

    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2) as client:  # the previous test's restarts are done
        # 4 micro-batches a step (2 agents x 16 samples / 8): the 6th is in step 1, its agent at v1
        fault = WorkerFault(client, "train", nth=6)
        result, weights = train(cfg, tmp_path / "run", address, on_submit=on_submit)
        assert fault.fired.wait(10), fault.at
    assert any(fault.worker in r.workers and r.recovered_at is not None for r in result.recoveries)
    assert written(tmp_path / "run", struck[0], range(1, 2)) == [1]  # not written by the run: rebuilt by replay
    assert_exact(tmp_path / "run", cfg, weights)


def test_a_driver_killed_between_snapshots_resumes_by_replay_exactly(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config(EVERY)
    run_dir = tmp_path / "run"
    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2):
        pass
    # 8 sample commits make the run (2 agents x 2 steps x 2 micro-batches): the 5th is in step 1
    kill_driver(cfg, run_dir, address, 5)
    store = ExperienceStore(run_dir / "store")
    at = {a: store.policy_version(a) for a in cfg.agents}
    assert 1 in at.values() and max(at.values()) < cfg.run.steps, at  # died between snapshots
    assert all(written(run_dir, a, range(1, 3)) == [] for a in cfg.agents)  # nothing written before v2
    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2):
        pass
    result, weights = train(resume_config(run_dir), run_dir, address, resume=True)
    assert result.samples_reused > 0
    assert_exact(run_dir, cfg, weights)
