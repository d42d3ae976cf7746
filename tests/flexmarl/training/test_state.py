from __future__ import annotations

import torch

from flexmarl.models.loading import resolve_model
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import load_state, move, save_state
from flexmarl.training.trainer import AgentTrainer

from .test_trainer import make_batch


def snapshot(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.clone() for k, v in trainer.weights().items()}
    for i, per_param in trainer.optimizer.state.items():
        for name, value in per_param.items():
            out[f"o.{i}.{name}"] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def test_disk_round_trip_is_bit_exact_and_training_resumes_identically(tiny_dir, tmp_path) -> None:
    cfg = TrainerConfig(lr=1e-3)
    a = AgentTrainer("solver", tiny_dir, cfg, temperature=1.0)
    a.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5]))
    written = save_state(a, tmp_path / "state")
    assert written > sum(v.numel() * 4 for v in a.weights().values())  # weights and both Adam moments

    b = AgentTrainer("solver", tiny_dir, cfg, temperature=1.0)  # fresh: v0 weights, empty optimizer
    load_state(b, tmp_path / "state")
    assert b.version == a.version == 1
    before = snapshot(a)
    assert before.keys() == snapshot(b).keys()
    assert all(torch.equal(before[k], snapshot(b)[k]) for k in before)

    batch = make_batch(tiny_dir, [0.5, -0.5, 1.0])
    a.train_step(batch)
    b.train_step(batch)
    after_a, after_b = snapshot(a), snapshot(b)
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_state_of_another_agent_is_refused(tiny_dir, tmp_path) -> None:
    import pytest

    a = AgentTrainer("solver", tiny_dir, TrainerConfig(), temperature=1.0)
    save_state(a, tmp_path / "state")
    with pytest.raises(ValueError, match="belongs to agent 'solver', not 'verifier'"):
        load_state(AgentTrainer("verifier", tiny_dir, TrainerConfig(), temperature=1.0), tmp_path / "state")


def test_host_device_round_trip_keeps_the_state(tiny_dir) -> None:
    a = AgentTrainer("solver", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    a.train_step(make_batch(tiny_dir, [1.0, -1.0]))
    before = snapshot(a)
    move(a, "host")
    move(a, "device")
    after = snapshot(a)
    assert all(torch.equal(before[k], after[k]) for k in before)
    a.train_step(make_batch(tiny_dir, [1.0, -1.0]))  # still trains after the moves
    assert a.version == 2


def test_swap_benchmark_reports_every_leg_and_a_bit_exact_round_trip(model_cache) -> None:
    from flexmarl.bench.swap_bench import bench_swap

    report = bench_swap(["tiny"], log=lambda _: None)
    tiny = report["models"]["tiny"]
    assert report["bit_exact"] and tiny["bit_exact"] and tiny["device"] == report["device"]
    params = AgentTrainer("x", resolve_model("tiny"), TrainerConfig(), temperature=1.0).model.parameters()
    assert tiny["state_bytes"] >= 3 * sum(p.numel() * 4 for p in params)  # weights + two Adam moments
    for leg in ("to_host_s", "to_device_s", "to_disk_s", "from_disk_s"):
        assert tiny[leg] > 0
