"""Shared by the reliability tests: a cluster for each test, and the weights of an uninterrupted run to compare with.

Every test here is a real tiny run (2 steps) hit by a real fault: a worker process SIGKILLed or SIGSTOPped,
a driver process SIGKILLed, a flow attempt failing. After it, the store must verify, every planned prompt
must have been trained exactly once per step, and the weights (staleness 0) must equal the uninterrupted
run's up to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexmarl.bench.chaos_bench import train
from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster
from flexmarl.config import RunConfig, load_config
from flexmarl.orchestrator.coverage import training_coverage
from flexmarl.reference import DRIFT_TOLERANCE, initial_weights, weight_drift
from flexmarl.training.snapshots import SNAPSHOTS, load_weights, snapshot_uri
from storage.store import ExperienceStore
from storage.verify import verify_store

STEPS = 2
# Heartbeats can lag for seconds while a fresh worker imports torch on a loaded machine: only the test of
# heartbeat detection shortens it.
# Seed 3: both tiny agents get a gradient (at seed 0 every group of verdicts ties, so the verifier has none).
SETTINGS = [f"run.steps={STEPS}", "run.seed=3", "cluster.heartbeat_timeout_s=120", "rollout.request_timeout_s=60"]


def tiny(*extra: str) -> RunConfig:
    return load_config(preset="tiny", overrides=[*SETTINGS, *extra])


@pytest.fixture(scope="package")
def settings() -> list[str]:
    """The overrides of the tiny preset every reliability test runs with (for command-line runs)."""
    return list(SETTINGS)


@pytest.fixture(scope="package")
def tiny_config():
    """``tiny(*overrides)``: the tiny preset with the reliability tests' settings (short fault detection)."""
    return tiny


RESTART_WAIT_S = 180
"""How long a test waits for its cluster's nannies to restart the workers it killed: seconds on an idle machine,
and a bound, not a speed target, on a busy one."""


@pytest.fixture
def address():
    """A cluster of the test's own. Every test here kills or freezes workers: on a shared cluster a nanny whose
    restart went wrong failed every later test of the package (issue 31), so no test depends on another's."""
    with open_cluster(ClusterConfig(n_workers=2)) as addr:
        yield addr


@pytest.fixture(scope="package")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Every agent's final weights after an uninterrupted run of the same config and seed."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    with open_cluster(ClusterConfig(n_workers=2)) as address:
        _, weights = train(tiny(), run_dir, address)
    return weights


def final_weights(run_dir: Path, cfg: RunConfig) -> dict[str, dict[str, torch.Tensor]]:
    """The final weights as the run wrote them: each agent's training-state snapshot of its last version."""
    root = str(run_dir / "state" / SNAPSHOTS)
    return {a: load_weights(snapshot_uri(root, a, cfg.run.steps)) for a in cfg.agents}


@pytest.fixture(scope="package")
def assert_exact(reference: dict):
    """``assert_exact(run_dir, cfg, weights)``: see ``check_exact``."""
    return lambda run_dir, cfg, weights: check_exact(run_dir, cfg, weights, reference)


@pytest.fixture(scope="package")
def weights_of():
    """``weights_of(run_dir, cfg)``: see ``final_weights``."""
    return final_weights


def check_exact(run_dir: Path, cfg: RunConfig, weights: dict, reference: dict) -> None:
    """The run's store verifies, it trained every planned prompt exactly once per step, and its weights equal
    the uninterrupted run's (the weights moved, so this is not trivially true)."""
    store = ExperienceStore(run_dir / "store")
    assert verify_store(store) == []
    coverage = training_coverage(store, cfg)
    assert coverage.steps == cfg.run.steps and coverage.exact, coverage
    start = initial_weights(cfg)
    assert weight_drift(reference, weights, start) <= DRIFT_TOLERANCE
    # some agent's weights moved (which one depends on the sampled answers: an agent whose groups all tie has
    # no gradient), so the comparison is not between two untrained models
    assert max(float((weights[a][k] - start[a][k]).abs().max()) for a in start for k in start[a]) > 1e-4
