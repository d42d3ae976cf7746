"""prefect.yaml deploys what users run: every shipped preset and example, with parameters the flow accepts."""

from __future__ import annotations

from pathlib import Path

import yaml

from deployments.serve import FLOWS, deployments_from_yaml
from flexmarl.config import PRESETS, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_preset_and_example_has_a_deployment_whose_parameters_validate() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    train = [d for d in spec["deployments"] if d["entrypoint"] == "flows/train.py:train_run"]
    assert {d["parameters"].get("preset") for d in train} >= set(PRESETS)
    examples = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.yaml")}
    assert examples and {d["parameters"].get("config") for d in train} >= examples
    for d in spec["deployments"]:
        FLOWS[d["entrypoint"]].validate_parameters(d.get("parameters", {}))  # the schema a run is checked against
        assert d["description"] and d["work_pool"]["name"] == "flexmarl-pool", d["name"]
    for d in train:
        params = d["parameters"]
        if "resume" in params:  # continues a run with the run's own config
            continue
        config = ROOT / params["config"] if "config" in params else None
        load_config(config, preset=params.get("preset") if config is None else None)  # and the config loads
    assert len(deployments_from_yaml(ROOT / "prefect.yaml")) == len(spec["deployments"])  # `serve` reads them all
