"""MLflow backend: one MLflow run per FlexMARL run, metrics per agent update, the config as params."""

from __future__ import annotations

import time
from pathlib import Path

MAX_PARAMS_PER_CALL = 100  # MLflow's log_batch limit
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


class MlflowLogger:
    """Logs through ``MlflowClient`` (no global active run, so two runs in one process do not mix).

    Args:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://...``).
        experiment: experiment name; created when missing.
        run_name: the MLflow run's name (the FlexMARL run id); the run of that name is continued if it exists.
        artifact_dir: artifact location of a newly created experiment (None: the server's default).
        tags: tags of the MLflow run.
    """

    def __init__(
        self, tracking_uri: str, *, experiment: str, run_name: str, artifact_dir: Path | None, tags: dict[str, str]
    ) -> None:
        from mlflow.tracking import MlflowClient  # imported here: only runs that ask for it pay for it

        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = artifact_dir.resolve().as_uri() if artifact_dir is not None else None
            experiment_id = self._client.create_experiment(experiment, artifact_location=location)
        # A run id names one FlexMARL run: a second tracker of it (the flow's report, after the pipeline's
        # tracker closed) continues its MLflow run instead of starting another.
        found_runs = self._client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{run_name}'",
                                              max_results=1)
        if found_runs:
            self.run_id = found_runs[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_params(self, params: dict[str, str], config_yaml: str) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_CALL])
        self._client.log_text(self.run_id, config_yaml, "config.yaml")

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()])

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
