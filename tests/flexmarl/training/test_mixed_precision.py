"""Run-wide mixed precision through one Accelerator per process."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate.state import AcceleratorState

from flexmarl.config import ConfigError, load_config
from flexmarl.training import trainer as trainer_module
from flexmarl.training.config import TrainerConfig
from flexmarl.training.trainer import AcceleratorConflict, AgentTrainer

from .test_trainer import make_batch, params


@pytest.fixture
def fresh_process_accelerator():
    """This test's trainers build the process's Accelerator as a fresh worker would; the session's comes back
    afterwards (accelerate keeps its configuration in process-wide state)."""
    saved = trainer_module._ACCELERATOR
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer_module._ACCELERATOR = None
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer_module._ACCELERATOR = None
    if saved is not None:  # rebuild the session's configuration, which the Accelerators already built share
        trainer_module.shared_accelerator(saved[0])
        trainer_module._ACCELERATOR = saved


def test_bf16_on_cpu_trains_with_float32_master_weights(tiny_dir, fresh_process_accelerator) -> None:
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3, mixed_precision="bf16"), temperature=1.0)
    assert trainer.accelerator.mixed_precision == "bf16"
    ids = torch.tensor([[257, 10, 20]])
    with torch.no_grad():  # the prepared model computes under bf16 autocast (outputs cast back to float32)
        mixed, full = trainer.model(input_ids=ids).logits, trainer.model._original_forward(input_ids=ids).logits
    assert not torch.equal(mixed, full) and torch.allclose(mixed, full, atol=0.1)
    before = params(trainer)
    result = trainer.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5]))
    assert not result.skipped and math.isfinite(result.metrics["loss/policy"])
    after = trainer.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # autocast computes, fp32 stores
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_a_second_different_configuration_in_one_process_is_refused(tiny_dir, fresh_process_accelerator) -> None:
    AgentTrainer("a", tiny_dir, TrainerConfig(mixed_precision="bf16"), temperature=1.0)
    AgentTrainer("b", tiny_dir, TrainerConfig(mixed_precision="bf16"), temperature=1.0)  # the same: shared
    with pytest.raises(AcceleratorConflict, match=r"already trains with training.mixed_precision='bf16' and cannot "
                                                  r"switch to 'no'.*restart the Dask workers"):
        AgentTrainer("c", tiny_dir, TrainerConfig(mixed_precision="no"), temperature=1.0)


def test_fp16_is_refused_naming_the_reason_and_the_alternative() -> None:
    with pytest.raises(ConfigError, match=r"training.mixed_precision: 'fp16' is not supported: it needs a loss "
                                          r"scale per agent.*use 'bf16'"):
        load_config(preset="tiny", overrides=["training.mixed_precision=fp16"])


@pytest.mark.parametrize("key, value", [("mixed_precision", "bf16"), ("slots", "1"), ("state_uri", "/tmp/x")])
def test_run_wide_training_settings_cannot_be_set_per_agent(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"agents.solver.training.{key}: {key} is run-wide; set training.{key}"):
        load_config(preset="tiny", overrides=[f"agents.solver.training={{{key}: {value}}}"])
    cfg = load_config(preset="tiny", overrides=[f"training.{key}={value}"])
    assert str(getattr(cfg.trainer_config("solver"), key)) == value  # run-wide, every agent gets it
