"""Settings of experiment tracking: TensorBoard and MLflow, each off by default."""

from __future__ import annotations

from pydantic import Field

from flexmarl.configbase import Strict


class TrackingConfig(Strict):
    tensorboard: bool = False
    """Write each agent update's metrics as TensorBoard scalars under RUN_DIR/tensorboard
    (``tensorboard --logdir RUN_DIR/tensorboard``). Needs the ``tensorboard`` package."""
    mlflow: bool = False
    """Log each agent update's metrics, the resolved config (as params) and the run's summary to MLflow.
    Needs ``mlflow-skinny`` (installed by ``make setup``)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI; null keeps a SQLite file store under the run directory
    (``sqlite:///RUN_DIR/mlflow.db``; MLflow 3 refuses its older plain-folder store). Give
    ``http://host:5000`` for a tracking server."""
    mlflow_experiment: str = Field("flexmarl", min_length=1)
    """MLflow experiment the run is logged under (created when missing)."""
