"""Experiment tracking: stable keys, real TensorBoard and MLflow files, and a backend failing mid-run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flexmarl.config import load_config
from flexmarl.orchestrator.records import UpdateEvent
from flexmarl.tracking import tracker as tracker_module
from flexmarl.tracking.config import TrackingConfig
from flexmarl.tracking.keys import update_metrics
from flexmarl.tracking.tensorboard_writer import TensorBoardWriter
from flexmarl.tracking.tracker import RunTracker, TrackingError


def event(agent: str, version: int, *, reward: float | None, at: float, tokens: int = 100) -> UpdateEvent:
    return UpdateEvent(agent, version - 1, version, samples=16, tokens=tokens, mean_reward=reward,
                       metrics={"loss/policy": 0.5 / version, "policy/clipfrac": 0.1, "grad_norm": 2.0,
                                "micro_batches": 2.0}, finished_at=at, staleness=0.25, queue_depth=3)


def test_update_metrics_use_stable_namespaced_keys() -> None:
    metrics = update_metrics(event("solver", 2, reward=0.75, at=5.0, tokens=300), previous_s=2.0)
    assert metrics == {
        "solver/reward/mean": 0.75, "solver/loss/policy": 0.25, "solver/policy/clipfrac": 0.1,
        "solver/optim/grad_norm": 2.0, "solver/batch/micro_batches": 2.0, "solver/batch/samples": 16.0,
        "solver/batch/tokens": 300.0, "solver/rollout/staleness": 0.25, "solver/rollout/queue_depth": 3.0,
        "solver/update/skipped": 0.0, "solver/update/finished_s": 5.0, "solver/throughput/tokens_per_s": 100.0,
    }
    # an update without a rewarded sample logs no reward rather than a made-up one
    assert "verifier/reward/mean" not in update_metrics(event("verifier", 1, reward=None, at=1.0), previous_s=0.0)


def test_tensorboard_and_mlflow_receive_every_update_at_its_version(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(preset="tiny", overrides=["tracking.tensorboard=true", "tracking.mlflow=true"])
    with RunTracker(cfg.tracking, run_dir=tmp_path, run_name="run-1", config=cfg) as tracker:
        assert tracker.enabled == ["tensorboard", "mlflow"]
        for version, (at, reward) in enumerate([(1.0, 0.25), (3.0, 0.5)], start=1):
            tracker.log_update(event("solver", version, reward=reward, at=at))
        tracker.log_report({"wall_s": 9.0, "pipeline_s": 4.0, "utilization": 0.5, "tokens_per_s": 50.0,
                            "store_write_s": 0.1, "store_read_s": 0.2})

    scalars = EventAccumulator(str(tmp_path / "tensorboard"))
    scalars.Reload()
    assert [(e.step, e.value) for e in scalars.Scalars("solver/reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in scalars.Scalars("solver/throughput/tokens_per_s")] == [(1, 100.0), (2, 50.0)]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("flexmarl").experiment_id])[0]
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "solver/loss/policy")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["run/utilization"] == 0.5
    assert run.data.params["run.steps"] == str(cfg.run.steps)
    assert run.data.params["agents.solver.prompt"] == cfg.agents["solver"].prompt
    config_file = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert Path(config_file).read_text().startswith("agents:")


def test_a_backend_that_fails_mid_run_is_dropped_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(preset="tiny", overrides=["tracking.tensorboard=true"])

    def broken(self, metrics, *, step):  # a fault injected into the real writer
        raise OSError("disk full")

    monkeypatch.setattr(TensorBoardWriter, "log_metrics", broken)
    with caplog.at_level(logging.WARNING), RunTracker(cfg.tracking, run_dir=tmp_path, run_name="r", config=cfg) as t:
        t.log_update(event("solver", 1, reward=0.0, at=1.0))
        assert t.enabled == []
        t.log_update(event("solver", 2, reward=0.0, at=2.0))  # nothing left to log to: no error
    assert "tensorboard failed to log solver v1 (disk full)" in caplog.text


def test_a_missing_package_or_bad_uri_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(preset="tiny", overrides=["tracking.mlflow=true"])
    real = tracker_module.importlib.util.find_spec
    monkeypatch.setattr(tracker_module.importlib.util, "find_spec", lambda n: None if n == "mlflow" else real(n))
    with pytest.raises(TrackingError, match="tracking.mlflow is on but the mlflow package is missing.*=false"):
        RunTracker(cfg.tracking, run_dir=tmp_path, run_name="r", config=cfg)
    monkeypatch.undo()

    bad = cfg.model_copy(update={"tracking": TrackingConfig(mlflow=True, mlflow_uri="nosuchscheme://x")})
    with pytest.raises(TrackingError, match="MLflow cannot log to 'nosuchscheme://x'.*tracking.mlflow_uri"):
        with RunTracker(bad.tracking, run_dir=tmp_path, run_name="r", config=bad):
            pass


def test_tracking_is_off_by_default_and_then_writes_nothing(tmp_path: Path) -> None:
    cfg = load_config(preset="tiny")
    with RunTracker(cfg.tracking, run_dir=tmp_path, run_name="r", config=cfg) as tracker:
        tracker.log_update(event("solver", 1, reward=1.0, at=1.0))
    assert tracker.enabled == [] and list(tmp_path.iterdir()) == []
