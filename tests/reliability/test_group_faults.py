"""Trainer groups on a real LocalCluster with nannies. A rank killed mid-step: the group is given up, the trainer
rebuilt from its snapshot, the step redone from the store, and the weights equal the plain loop's
(``flexmarl/reference.py``). A run resumed with another ``training.max_slots`` continues exactly."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from flexmarl.bench.chaos_bench import RankFault, WorkerFault, train
from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster
from flexmarl.reference import initial_weights, reference_run
from flexmarl.run.plan import resume_config
from flexmarl.training.snapshots import SNAPSHOTS, snapshot_problem, snapshot_uri

from .conftest import check_exact
from .test_worker_faults import recovery_of, run_with_fault

# Two agents on three workers, eight micro-batches per agent and step (one query each): the verifier grows into
# the idle third slot; the solver keeps one. The verifier has a gradient at the reliability tests' seed, so its
# all-reduce shows in its weights (``moved``).
GROUPS = ["run.queries_per_step=8", "training.micro_batch_size=4", "training.max_slots=2",
          "agents.solver.training.max_slots=1", "run.snapshot_every=1"]


@pytest.fixture
def address():
    with open_cluster(ClusterConfig(n_workers=3)) as addr:
        yield addr


@pytest.mark.parametrize("task_kind", ["train", "finish"])
def test_a_rank_killed_mid_step_is_recovered_and_the_weights_equal_the_plain_loop(
    tmp_path: Path, address: str, tiny_config, task_kind: str
) -> None:
    cfg = tiny_config(*GROUPS)
    fault = RankFault(None, task_kind, nth=1)
    result, weights, trainers = run_with_fault(cfg, tmp_path / "run", address, fault)
    assert fault.joined is not None and fault.worker == fault.joined[1]
    recovery_of(result, fault.worker)
    assert fault.worker not in trainers.values()
    check_exact(tmp_path / "run", cfg, weights, reference_run(cfg))
    assert moved(cfg, weights, "verifier")


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_a_run_resumed_at_another_group_size_continues_exactly(tmp_path: Path, address: str, tiny_config,
                                                              first: int, then: int) -> None:
    """Every rank holds the whole state and the home snapshots it: a run saved while trained by groups of two
    resumes on one slot per agent, and the reverse; the store verifies and the weights equal the plain loop's."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(*GROUPS, f"training.max_slots={first}")
    result, _ = train(cfg, run_dir, address)
    assert max(u.metrics["ranks"] for u in result.updates) == first
    resumed = resume_config(run_dir, ["run.steps=4", f"training.max_slots={then}"])
    result, weights = train(resumed, run_dir, address, resume=True)
    assert max(u.metrics["ranks"] for u in result.updates) == then and min(u.step for u in result.updates) == 2
    check_exact(run_dir, resumed, weights, reference_run(resumed))
    assert moved(resumed, weights, "verifier")


def moved(cfg, weights: dict, agent: str) -> bool:
    start = initial_weights(cfg)[agent]
    return max(float((weights[agent][k] - start[k]).abs().max()) for k in start) > 1e-4


SHARDED = ["run.queries_per_step=8", "training.micro_batch_size=4", "agents.solver.training.sharding=full",
           "agents.solver.training.max_slots=2"]


@dataclass
class ShardFault(WorkerFault):
    """Kill the worker of the ``nth`` job of ``task_kind`` that ``agent`` sends (a rank of a sharded trainer)."""

    agent: str = "solver"

    def __call__(self, kind: str, agent: str, worker: str) -> None:
        if agent == self.agent:
            super().__call__(kind, agent, worker)


@pytest.mark.parametrize("task_kind,nth,sharding,sharded,every", [("train", 5, "full", ("solver",), 1),
                                                                  ("finish", 2, "full", ("solver",), 1),
                                                                  ("finish", 3, "optimizer", ("solver",), 1),
                                                                  ("finish", 2, "full", ("solver", "verifier"), 1),
                                                                  ("finish", 3, "full", ("solver",), 3)],
                         ids=["train-full", "finish-full", "finish-optimizer", "finish-full-both",
                              "finish-full-replayed"])
def test_a_rank_of_a_sharded_trainer_killed_mid_step_is_rebuilt_and_the_weights_equal_the_plain_loop(
    tmp_path: Path, address: str, tiny_config, task_kind: str, nth: int, sharding: str, sharded: tuple[str, ...],
    every: int,
) -> None:
    """The solver's state sharded over both workers (FSDP2, or ZeRO-1's moments); one of them is killed while its
    rank trains a micro-batch (the other's collective fails), or takes its part of the optimizer step: its ranks
    are formed again with the nanny's replacement, each rebuilds its shards from the snapshot of the step's
    start, the step is redone from the store, and the weights equal the plain loop's. With the verifier sharded
    over the same ranks too, both are rebuilt, in one new world. With ``run.snapshot_every=3`` the run wrote no
    state of the step's start (v1): the new ranks rebuild it from the model by replaying the store's update
    together, and write it."""
    cfg = tiny_config(*SHARDED, f"run.snapshot_every={every}",
                      *(f"agents.{a}.training.{k}" for a in sharded for k in (f"sharding={sharding}", "max_slots=2")))
    fault = ShardFault(None, task_kind, nth=nth)
    result, weights, trainers = run_with_fault(cfg, tmp_path / "run", address, fault)
    recovery_of(result, fault.worker)
    assert fault.worker not in trainers.values()
    assert all(u.metrics["ranks_trained"] == 2 for u in result.updates if u.agent in sharded)
    if every > 1:  # written by the rebuild, not by the run's schedule
        assert snapshot_problem(str(tmp_path / "run" / "state" / SNAPSHOTS), "solver", 1) is None
    check_exact(tmp_path / "run", cfg, weights, reference_run(cfg))


def test_a_sharded_run_resumed_at_another_number_of_ranks_continues_exactly(tmp_path: Path, address: str,
                                                                           tiny_config) -> None:
    """Saved sharded over two ranks, resumed over one (its distributed checkpoint resharded), exactly."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(*SHARDED, "run.snapshot_every=1")
    train(cfg, run_dir, address)
    resumed = resume_config(run_dir, ["run.steps=4", "agents.solver.training.max_slots=1"])
    result, weights = train(resumed, run_dir, address, resume=True)
    assert min(u.step for u in result.updates) == 2
    assert {u.metrics.get("ranks", 1.0) for u in result.updates if u.agent == "solver"} == {1.0}
    check_exact(run_dir, resumed, weights, reference_run(resumed))


def test_a_sharded_state_the_run_did_not_write_is_rebuilt_at_resume_by_its_ranks_together(
        tmp_path: Path, address: str, tiny_config) -> None:
    """``run.snapshot_every=3`` over 2 steps writes v2 only; with it removed, the resumed run's two ranks rebuild
    it from the model by replaying the store's two updates together (each its part of every micro-batch, the
    gradients summed over both), write it, and continue exactly."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(*SHARDED, "run.snapshot_every=3")
    train(cfg, run_dir, address)
    root = str(run_dir / "state" / SNAPSHOTS)
    assert [v for v in (1, 2) if snapshot_problem(root, "solver", v) is None] == [2]
    shutil.rmtree(snapshot_uri(root, "solver", 2))
    resumed = resume_config(run_dir, ["run.steps=4"])
    result, weights = train(resumed, run_dir, address, resume=True)
    assert min(u.step for u in result.updates) == 2  # it started from v2: rebuilt (and pruned again at v4)
    assert {u.metrics["ranks_trained"] for u in result.updates if u.agent == "solver"} == {2.0}
    check_exact(run_dir, resumed, weights, reference_run(resumed))
