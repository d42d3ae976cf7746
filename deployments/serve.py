"""Serve the deployments of ``prefect.yaml`` from this process, without a work pool or worker.

    python -m deployments.serve            # every deployment, with its schedules
    python -m deployments.serve tiny daily # only the named ones

The definitions (parameters, schedules) are read from ``prefect.yaml``, their one source.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from prefect import serve
from prefect.schedules import Cron

from flows.evaluate import evaluate_run
from flows.maintain_store import maintain_store
from flows.train import train_run

FLOWS = {
    "flows/train.py:train_run": train_run,
    "flows/evaluate.py:evaluate_run": evaluate_run,
    "flows/maintain_store.py:maintain_store": maintain_store,
}


def deployments_from_yaml(path: Path, names: set[str] | None = None) -> list:
    spec = yaml.safe_load(path.read_text())
    out = []
    for d in spec["deployments"]:
        if names and d["name"] not in names:
            continue
        schedules = [
            Cron(s["cron"], timezone=s.get("timezone", "UTC"), active=s.get("active", True))
            for s in d.get("schedules", []) if "cron" in s
        ]
        out.append(FLOWS[d["entrypoint"]].to_deployment(
            name=d["name"], parameters=d.get("parameters", {}), tags=d.get("tags", []),
            description=d.get("description"), schedules=schedules,
        ))
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    serve(*deployments_from_yaml(root / "prefect.yaml", set(sys.argv[1:]) or None))
