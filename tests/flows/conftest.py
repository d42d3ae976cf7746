"""One real tiny run, shared by the tests of what a user does after a run (report, export, query, tracking)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest

QUERIES = 2


@dataclass(frozen=True)
class TinyRun:
    run_dir: Path
    flow_run_id: UUID
    report: dict


@pytest.fixture(scope="session")
def tiny_run(prefect_api, tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """The tiny preset, 2 steps, through the real flow, with TensorBoard and MLflow tracking on."""
    from flows.train import train_run

    run_dir = tmp_path_factory.mktemp("tiny-run") / "run"
    state = train_run(
        preset="tiny", steps=2, run_dir=str(run_dir), return_state=True,
        overrides=[f"run.queries_per_step={QUERIES}", "tracking.tensorboard=true", "tracking.mlflow=true"],
    )
    return TinyRun(run_dir, state.state_details.flow_run_id, state.result())
