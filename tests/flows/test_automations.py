"""The shipped automation, against a real Prefect API: a failed training run gets a resume run of its directory."""

from __future__ import annotations

import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.events.worker import EventsWorker

from deployments.automations import resume_failed_runs
from flows.train import train_run
from tasks.events import emit_run_failed


def test_a_failed_run_gets_a_resume_run_of_its_directory(prefect_api, tmp_path: Path) -> None:
    deployment_id = train_run.to_deployment(name="resume", parameters={"resume": "runs/default"}).apply()
    automation = resume_failed_runs(deployment_id).create()
    run_dir = tmp_path / "run"
    try:
        time.sleep(2)  # the triggers service loads new automations on its own clock
        emit_run_failed("run-test", str(run_dir), RuntimeError("a worker died"))
        EventsWorker.drain_all(timeout=30)
        deadline, runs = time.monotonic() + 90, []
        while not runs and time.monotonic() < deadline:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
            time.sleep(1)
        assert [r.parameters["resume"] for r in runs] == [str(run_dir.resolve())]
    finally:
        automation.delete()
