"""``RunTracker``: the tracking backends a run's config turns on, fed from the driver as updates land.

The training flow's pipeline task opens one around the pipeline and calls ``log_update`` for each agent
update event (in the driver, never on a worker); its report task opens one again, on the same MLflow run, and
calls ``log_report`` once at the end. With tracking off it does nothing.

Example:
    >>> with RunTracker(cfg.tracking, run_dir=run_dir, run_name=run_id, config=cfg) as tracker:
    ...     for event in events:
    ...         tracker.log_update(event)
    ...     tracker.log_report(report)
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import TracebackType
from typing import Protocol

from flexmarl.config import RunConfig, dotted_values, dump_config
from flexmarl.orchestrator.records import UpdateEvent
from flexmarl.tracking.config import TrackingConfig
from flexmarl.tracking.keys import run_metrics, update_metrics

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"


class TrackingError(RuntimeError):
    """A tracking backend that cannot start; the message names the setting and the fix."""


class Backend(Protocol):
    def log_params(self, params: dict[str, str], config_yaml: str) -> None: ...
    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None: ...
    def close(self, *, failed: bool) -> None: ...


def mlflow_uri(cfg: TrackingConfig, run_dir: Path) -> str:
    """The configured MLflow URI, or the SQLite file store under the run directory."""
    return cfg.mlflow_uri or f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"


def check_tracking(cfg: TrackingConfig) -> None:
    """Every backend ``cfg`` turns on has its package installed (a run's plan checks this before it starts).

    Raises:
        TrackingError: naming the setting and how to install the package.
    """
    for on, package, setting, install in (
        (cfg.tensorboard, "tensorboard", "tracking.tensorboard", "pip install tensorboard"),
        (cfg.mlflow, "mlflow", "tracking.mlflow", "pip install --no-deps mlflow-skinny: requirements-nodeps.txt"),
    ):
        if on and importlib.util.find_spec(package) is None:
            raise TrackingError(f"{setting} is on but the {package} package is missing: run `make setup` "
                                f"(or `{install}`), or set {setting}=false")


class RunTracker:
    """The enabled backends of one run.

    Args:
        cfg: the run's ``tracking`` settings.
        run_dir: the run directory (TensorBoard files and the default MLflow store go there).
        run_name: the run id, as the MLflow run's name (a second tracker of the run continues that MLflow run).
        config: the resolved run config, logged as params.

    Raises:
        TrackingError: a backend is on but its package is missing (checked here, before the run starts), or
            it cannot open its store (on ``__enter__``).
    """

    def __init__(self, cfg: TrackingConfig, *, run_dir: str | Path, run_name: str, config: RunConfig) -> None:
        check_tracking(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.config = config
        self._backends: dict[str, Backend] = {}
        self._last_s: dict[str, float] = {}  # agent -> when its previous update finished

    @property
    def enabled(self) -> list[str]:
        return list(self._backends)

    def __enter__(self) -> RunTracker:
        try:
            if self.cfg.tensorboard:
                from flexmarl.tracking.tensorboard_writer import TensorBoardWriter

                self._backends["tensorboard"] = TensorBoardWriter(self.run_dir / TENSORBOARD_DIR)
            if self.cfg.mlflow:
                from flexmarl.tracking.mlflow_logger import MlflowLogger

                uri = mlflow_uri(self.cfg, self.run_dir)
                try:
                    self._backends["mlflow"] = MlflowLogger(
                        uri, experiment=self.cfg.mlflow_experiment, run_name=self.run_name,
                        artifact_dir=None if self.cfg.mlflow_uri else self.run_dir / MLFLOW_ARTIFACTS,
                        tags={"flexmarl.run_dir": str(self.run_dir.resolve()), "flexmarl.mode": self.config.run.mode},
                    )
                except Exception as exc:  # MLflow raises many kinds (connection, SQL, its own)
                    raise TrackingError(f"MLflow cannot log to {uri!r}: {exc}; check tracking.mlflow_uri") from exc
        except BaseException:
            self._close(failed=True)
            raise
        params = {key: str(value) for key, value in dotted_values(self.config).items()}  # MLflow's are text
        self._each("log the config", lambda b: b.log_params(params, dump_config(self.config)))
        return self

    def log_update(self, event: UpdateEvent) -> None:
        """Log one agent update under its stable keys (``keys.py``), at step = the version it produced."""
        if not self._backends:
            return
        metrics = update_metrics(event, previous_s=self._last_s.get(event.agent, 0.0))
        self._last_s[event.agent] = event.finished_at
        self._each(f"log {event.agent} v{event.policy_version}",
                   lambda b: b.log_metrics(metrics, step=event.policy_version))

    def log_report(self, report: dict) -> None:
        """Log the run-level numbers of the final report (``run/wall_s``, ``run/utilization``, ...)."""
        metrics = run_metrics(report)
        self._each("log the run report", lambda b: b.log_metrics(metrics, step=self.config.run.steps))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close(failed=exc_type is not None)

    def _close(self, *, failed: bool) -> None:
        self._each("close", lambda b: b.close(failed=failed))
        self._backends.clear()

    def _each(self, what: str, call) -> None:
        # A tracking backend that fails mid-run (a server gone away) must not fail the training run: it is
        # reported once and dropped; the store and report.json still hold every number.
        for name, backend in list(self._backends.items()):
            try:
                call(backend)
            except Exception as exc:
                logger.warning("tracking: %s failed to %s (%s); no more %s logging in this run", name, what, exc, name)
                del self._backends[name]
