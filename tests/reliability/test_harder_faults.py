"""Harder faults: several in one run, a resume with stale samples, a damaged snapshot, a full disk.

Each is a real tiny run on the package's LocalCluster, hit by real signals to real processes. After it the
store must verify, every planned prompt must have been trained exactly once per step, and the weights must
equal an uninterrupted run's (staleness 0), or, where the schedule of versions depends on timing, the
replay of the run's own store from version 0 (``training/replay.py``).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.compute as pc
import pytest

from flexmarl.bench.chaos_bench import WorkerFault, all_of, kill_driver, sample_commits, train
from flexmarl.cluster.local import connect
from flexmarl.config import RunConfig
from flexmarl.models.loading import resolve_model
from flexmarl.orchestrator.coverage import training_coverage
from flexmarl.reference import DRIFT_TOLERANCE, initial_weights, weight_drift
from flexmarl.run.plan import resume_config
from flexmarl.training.replay import recorded_updates, replay
from flexmarl.training.snapshots import SNAPSHOTS
from flexmarl.training.state import META, WEIGHTS
from flexmarl.training.trainer import AgentTrainer
from storage.store import ExperienceStore
from storage.verify import verify_store

from .conftest import RESTART_WAIT_S
from .small_disk import Filler, SmallDisk, mounted_small_disk

ROOT = Path(__file__).resolve().parents[2]


def replayed_weights(run_dir: Path, cfg: RunConfig) -> dict:
    """Every agent's weights after replaying, from its model (v0), the updates its store recorded."""
    store = ExperienceStore(run_dir / "store")
    weights = {}
    for agent, spec in cfg.agents.items():
        config = cfg.trainer_config(agent)
        trainer = AgentTrainer(agent, str(resolve_model(spec.model, seed=cfg.run.seed)), config,
                               temperature=spec.sampling.temperature, max_new_tokens=spec.sampling.max_new_tokens)
        replay(trainer, store, recorded_updates(store, agent, after=0, upto=cfg.run.steps), config.micro_batch_size)
        weights[agent] = trainer.weights()
        trainer.close()
    return weights


def all_updated(store: ExperienceStore, cfg: RunConfig, version: int) -> bool:
    """Every agent's update to ``version`` is recorded."""
    try:
        return all(store.policy_version(a) >= version for a in cfg.agents)
    except Exception:  # noqa: BLE001 - the tables may not exist yet
        return False


def resume(run_dir: Path, address: str):
    return train(resume_config(run_dir), run_dir, address, resume=True)


def test_two_worker_faults_in_one_run_are_both_recovered_exactly(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config()
    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2) as client:
        faults = [WorkerFault(client, "generate", nth=2), WorkerFault(client, "train", nth=3)]
        result, weights = train(cfg, tmp_path / "run", address, on_submit=all_of(faults))
        assert all(f.fired.wait(10) for f in faults), [f.at for f in faults]
    recovered = [r for r in result.recoveries if r.recovered_at is not None]
    assert {f.worker for f in faults} <= {w for r in recovered for w in r.workers}, result.recoveries
    assert_exact(tmp_path / "run", cfg, weights)


def test_three_faults_two_workers_then_the_driver_killed_resume_exactly(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config()
    run_dir, fired = tmp_path / "run", tmp_path / "fired.log"
    # 8 sample commits make the run: the workers die early, the driver after the 5th commit (step 1) once both
    # worker faults fired
    kill_driver(cfg, run_dir, address, 5, faults=[("generate", 2), ("train", 2)], fired_log=fired)
    assert len(fired.read_text().splitlines()) == 2
    assert ExperienceStore(run_dir / "store").policy_version("verifier") < cfg.run.steps  # it died mid-run
    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2):
        pass  # the nannies restarted the two workers the driver killed
    result, weights = resume(run_dir, address)
    assert result.samples_reused > 0
    assert_exact(run_dir, cfg, weights)


def test_a_run_with_stale_samples_resumes_to_the_replay_of_its_own_store(
    tmp_path: Path, address: str, tiny_config
) -> None:
    """With ``max_staleness`` 1 the versions that generate each sample depend on timing, so an uninterrupted
    run is no oracle. What must hold: the resumed run trains each planned prompt once per step, stays within
    the bound, and its weights are those of training on exactly what its store recorded, in that order."""
    cfg = tiny_config("run.max_staleness=1", "run.steps=3")
    run_dir = tmp_path / "run"
    store = ExperienceStore(run_dir / "store")
    # 12 commits make the run; it dies once every agent trained a step (rollout runs ahead: commits alone say little)
    kill_driver(cfg, run_dir, address, 7, also=lambda: all_updated(store, cfg, 1))
    assert min(store.policy_version(a) for a in cfg.agents) < cfg.run.steps  # it died mid-run
    result, weights = resume(run_dir, address)
    assert result.samples_reused > 0
    assert verify_store(store, max_staleness=1) == []
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "store", "verify", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # the bound comes from the run's config
    assert verify.returncode == 0, verify.stdout + verify.stderr
    coverage = training_coverage(store, cfg)
    assert coverage.steps == cfg.run.steps and coverage.exact, coverage
    for agent in cfg.agents:
        rows = store.read_samples(agent, columns=["step", "policy_version"])
        assert pc.all(pc.greater_equal(rows["policy_version"], pc.subtract(rows["step"], 1))).as_py()
    start = initial_weights(cfg)
    assert weight_drift(replayed_weights(run_dir, cfg), weights, start) <= DRIFT_TOLERANCE


def test_a_damaged_newest_snapshot_is_rebuilt_from_the_one_before_and_the_store(
    tmp_path: Path, address: str, tiny_config, assert_exact, caplog
) -> None:
    cfg = tiny_config()
    run_dir = tmp_path / "run"
    store = ExperienceStore(run_dir / "store")
    kill_driver(cfg, run_dir, address, 5, also=lambda: all_updated(store, cfg, 1))
    versions = {a: store.policy_version(a) for a in cfg.agents}
    assert min(versions.values()) < cfg.run.steps  # it died mid-run
    snapshots = run_dir / "state" / SNAPSHOTS
    weights = snapshots / "solver" / f"v{versions['solver']}" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short
    (snapshots / "verifier" / f"v{versions['verifier']}" / META).write_text("{")  # does not parse
    with caplog.at_level(logging.WARNING, logger="flexmarl.orchestrator.runtime"):
        _, final = resume(run_dir, address)
    for agent, version in versions.items():
        base = f"its snapshot of v{version - 1}" if version > 1 else "its model (v0)"
        assert f"the snapshot of agent {agent!r} at v{version} has " in caplog.text
        assert f"rebuilding it from {base} by replaying the 1 update the store" in caplog.text
    assert_exact(run_dir, cfg, final)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A tmpfs of ``DISK_BYTES`` (a real ENOSPC when it fills), unmounted afterwards; then nothing may be left
    under its mount point on the real disk."""
    stack = contextlib.ExitStack()
    try:
        disk = stack.enter_context(mounted_small_disk(tmp_path / "disk"))
    except PermissionError as exc:
        pytest.skip(str(exc))
    with stack:
        yield disk
    assert not any(disk.path.iterdir()), f"written outside the tmpfs: {sorted(disk.path.iterdir())}"


@pytest.fixture
def fill_at_commit(small_disk: SmallDisk) -> Iterator[Callable[[ExperienceStore, list[str], int], Filler]]:
    """``fill_at_commit(store, agents, commits)``: fill the test's disk once the agents' sample tables hold
    ``commits`` commits. Every filler is stopped and joined before the disk is unmounted."""
    fillers: list[Filler] = []

    def start(store: ExperienceStore, agents: list[str], commits: int) -> Filler:
        fillers.append(Filler(small_disk, lambda: sample_commits(store, agents) >= commits, deadline_s=600).start())
        return fillers[-1]

    yield start
    for filler in fillers:
        filler.stop()


def test_a_disk_that_fills_up_mid_run_loses_nothing_committed_and_the_run_resumes(
    small_disk: SmallDisk, fill_at_commit, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config()
    run_dir = small_disk.path / "run"
    store = ExperienceStore(run_dir / "store")
    filler = fill_at_commit(store, list(cfg.agents), 3)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - whichever write hits the full disk first
        train(cfg, run_dir, address)
    filler.stop()
    assert filler.error is None and filler.full.is_set(), filler.error
    assert "No space left on device" in f"{failed.value!r} {failed.value.__cause__!r}", failed.value
    committed = {a: set(store.read_samples(a, columns=["sample_id"])["sample_id"].to_pylist()) for a in cfg.agents}
    assert sum(map(len, committed.values())) > 0
    assert verify_store(store) == []  # what was committed before the disk filled is whole
    filler.ballast.unlink()  # the user frees space, then resumes
    _, weights = resume(run_dir, address)
    for agent, ids in committed.items():
        assert ids <= set(store.read_samples(agent, columns=["sample_id"])["sample_id"].to_pylist())
    assert_exact(run_dir, cfg, weights)


def test_a_run_that_fails_before_the_filler_s_cue_leaves_every_disk_untouched(
    small_disk: SmallDisk, fill_at_commit, address: str, tiny_config
) -> None:
    """The filler waits for the third commit; the run fails on purpose before it. Nothing may be written: not on
    the tmpfs, and (``small_disk``'s teardown) not under its mount point once it is unmounted."""
    cfg = tiny_config()
    store = ExperienceStore(small_disk.path / "run" / "store")
    filler = fill_at_commit(store, list(cfg.agents), 3)

    def fail_at_first_training(kind: str, agent: str, worker: str) -> None:  # noqa: ARG001
        if kind == "train":
            raise RuntimeError("made to fail before the third commit")

    with pytest.raises(RuntimeError, match="made to fail before the third commit"):
        train(cfg, small_disk.path / "run", address, on_submit=fail_at_first_training)
    assert sample_commits(store, list(cfg.agents)) < 3
    filler.stop()
    assert filler.error is None and filler.written == 0 and not filler.ballast.exists()
