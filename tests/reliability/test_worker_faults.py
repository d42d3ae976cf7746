"""Worker processes killed or frozen mid-run on a real LocalCluster (with nannies): the run survives exactly.

The fault is a real signal to the worker process that runs the n-th generation batch or training micro-batch,
sent just after the pipeline submits it (``WorkerFault``). The nanny starts a new worker under a new address;
the supervisor must re-queue the lost rollout, rebuild the lost replicas and trainers, and retrain the step.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from flexmarl.bench.chaos_bench import WorkerFault
from flexmarl.cluster.local import connect
from flexmarl.orchestrator.runtime import RunContext, Runtime
from flexmarl.run.prepare import prepare_run

from .conftest import RESTART_WAIT_S


def run_with_fault(cfg, run_dir: Path, address: str, fault: WorkerFault):
    """A tiny run with ``fault`` armed; returns the pipeline result, final weights and final trainer placement."""
    with connect(address, timeout_s=RESTART_WAIT_S, n_workers=2) as client:  # both workers are up
        fault.client = client
        run_id, store_uri = prepare_run(cfg, run_dir)
        runtime = Runtime(RunContext(run_id, str(run_dir.resolve()), store_uri, address), cfg)
        try:
            runtime.start_engines()
            result = runtime.run(on_submit=fault)
            weights = {a: runtime.weights(a) for a in cfg.agents}
            trainers = dict(runtime.trainers)
        finally:
            runtime.close()
            if fault.sig == signal.SIGSTOP and fault.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # a failed test leaves no frozen worker behind
                    os.kill(fault.pid, signal.SIGCONT)
        assert fault.fired.wait(10), "the fault never fired: the run had fewer tasks of that kind"
    return result, weights, trainers


def recovery_of(result, worker: str):
    found = [r for r in result.recoveries if worker in r.workers]
    assert found, f"no recovery recorded for {worker}: {result.recoveries}"
    assert found[0].recovered_at is not None, found[0]
    return found[0]


def test_a_worker_killed_during_rollout_is_replaced_and_the_run_is_exact(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config()
    fault = WorkerFault(None, "generate", nth=3)
    result, weights, _ = run_with_fault(cfg, tmp_path / "run", address, fault)
    recovery = recovery_of(result, fault.worker)
    assert recovery.cause == "lost"
    # the killed worker's batches were generated again: more outputs generated than the run plans
    planned = cfg.run.steps * cfg.run.queries_per_step * cfg.run.group_size * len(cfg.graph.expanded.nodes)
    assert result.samples_generated >= planned
    assert_exact(tmp_path / "run", cfg, weights)


def test_a_worker_killed_during_a_training_micro_batch_retrains_the_step_exactly(
    tmp_path: Path, address: str, tiny_config, assert_exact
) -> None:
    cfg = tiny_config()
    fault = WorkerFault(None, "train", nth=2)
    result, weights, trainers = run_with_fault(cfg, tmp_path / "run", address, fault)
    recovery_of(result, fault.worker)
    # the trainer that lived on the killed worker was rebuilt elsewhere, from its snapshot
    assert fault.worker not in trainers.values()
    assert_exact(tmp_path / "run", cfg, weights)


@pytest.mark.parametrize("detected_by", ["heartbeat", "request_timeout"])
def test_a_replica_that_stops_answering_is_replaced(
    tmp_path: Path, address: str, tiny_config, assert_exact, detected_by: str
) -> None:
    # SIGSTOP freezes the worker process: its tasks never finish and it stops heartbeating
    settings = (["cluster.heartbeat_timeout_s=15"] if detected_by == "heartbeat"
                else ["rollout.request_timeout_s=30"])
    cfg = tiny_config(*settings)
    fault = WorkerFault(None, "generate", nth=2, sig=signal.SIGSTOP)
    result, weights, _ = run_with_fault(cfg, tmp_path / "run", address, fault)
    recovery = recovery_of(result, fault.worker)
    # when the signal lands just after the batch finished, the worker is found holding its value unanswered
    expected = (["cluster.heartbeat_timeout_s"] if detected_by == "heartbeat"
                else ["rollout.request_timeout_s", "cannot be fetched"])
    assert recovery.cause.startswith("hung: ") and any(e in recovery.cause for e in expected), recovery.cause
    assert_exact(tmp_path / "run", cfg, weights)
