"""The training flow's run form: typed fields taken from the config, one list of presets and settings."""

from __future__ import annotations

import inspect
import typing

import pytest
from prefect.exceptions import ParameterTypeError

from flexmarl.config import PRESETS, RUN_FORM_SETTINGS, RunConfig, load_config, run_overrides
from flows.train import train_run


def config_field(key: str):
    model, *path, name = [RunConfig, *key.split(".")]
    for part in path:
        model = model.model_fields[part].annotation
    return model.model_fields[name]


def test_every_form_setting_is_a_flow_parameter_typed_as_its_config_field() -> None:
    params = inspect.signature(train_run.fn).parameters
    hints = typing.get_type_hints(train_run.fn)
    for name, key in RUN_FORM_SETTINGS.items():
        assert name in params and params[name].default is None, name  # empty: the config's own value holds
        assert hints[name] == config_field(key).annotation | None, (name, hints[name])
    schema = train_run.parameters.model_dump()["properties"]
    assert {"enum": ["flexmarl", "sync"], "type": "string"} in schema["mode"]["anyOf"]
    assert {"type": "number"} in schema["lr"]["anyOf"]
    assert {"enum": list(PRESETS), "type": "string"} in schema["preset"]["anyOf"]
    assert all(schema[name]["description"] for name in RUN_FORM_SETTINGS)


def test_the_form_refuses_a_wrong_type_and_its_values_reach_the_config() -> None:
    with pytest.raises(ParameterTypeError, match="mode"):
        train_run.validate_parameters({"mode": "fast"})
    with pytest.raises(ParameterTypeError, match="preset"):
        train_run.validate_parameters({"preset": "huge"})
    train_run.validate_parameters({"preset": "fan_out", "lr": 1e-5, "mode": "sync"})
    extra = run_overrides(["training.clip_eps=0.1"], "tcp://h:8786", lr=1e-5, mode="sync", steps=None)
    assert extra == ["training.clip_eps=0.1", "training.lr=1e-05", "run.mode=sync", "cluster.address=tcp://h:8786"]
    cfg = load_config(preset="tiny", overrides=extra)
    assert (cfg.training.lr, cfg.run.mode, cfg.training.clip_eps) == (1e-5, "sync", 0.1)
    with pytest.raises(TypeError, match="not run-form settings"):
        run_overrides(None, learning_rate=1.0)
