"""Prefect automations that ship with FlexMARL (docs/operations.md, "Automations").

    python -m deployments.automations    # create them on the Prefect API of PREFECT_API_URL

``resume-failed-runs``: when a training flow run fails (the flow emits ``flexmarl.run.failed`` with the run
directory in its payload), run the ``flexmarl-train/resume`` deployment on that directory. The run goes on
from its store and training-state snapshots; a failure the resume cannot fix (``store verify`` finds a
problem, a bad config) fails it again with its own one-line error, and the automation fires once per failure.
"""

from __future__ import annotations

from prefect.automations import Automation, EventTrigger, Posture, RunDeployment
from prefect.client.orchestration import get_client

from tasks.events import RUN_FAILED

RESUME_DEPLOYMENT = "flexmarl-train/resume"


def resume_failed_runs(deployment_id) -> Automation:
    return Automation(
        name="resume-failed-runs",
        description=f"Resume a failed FlexMARL training run from its run directory ({RESUME_DEPLOYMENT})",
        trigger=EventTrigger(expect={RUN_FAILED}, match={"prefect.resource.id": "flexmarl.run.*"},
                             posture=Posture.Reactive, threshold=1),
        actions=[RunDeployment(source="selected", deployment_id=deployment_id,
                               parameters={"resume": "{{ event.payload.run_dir }}"})],
    )


def create_all() -> list[Automation]:
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(RESUME_DEPLOYMENT)
    return [resume_failed_runs(deployment.id).create()]


if __name__ == "__main__":
    for automation in create_all():
        print(f"created automation {automation.name} ({automation.id})")
