"""The one location API for an agent's training state: every location round-trips bit-exactly."""

from __future__ import annotations

import pytest
import torch

from flexmarl.bench.swap_bench import same_state
from flexmarl.models.loading import resolve_model
from flexmarl.training.config import TrainerConfig
from flexmarl.training import state as state_module
from flexmarl.training.state import DEVICE, HOST, HostCopy, HostPool, TrainingState
from flexmarl.training.trainer import AgentTrainer

from .test_trainer import make_batch

CONFIG = TrainerConfig(lr=1e-3, lr_warmup_steps=3)  # a scheduler too, so that its state must travel


def trained(tiny_dir, agent: str = "solver") -> AgentTrainer:
    trainer = AgentTrainer(agent, tiny_dir, CONFIG, temperature=1.0)
    trainer.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5]))
    return trainer


@pytest.mark.parametrize("where", ["host", "directory", "file-uri", "memory-uri"])
def test_a_round_trip_through_each_location_onto_a_fresh_trainer_is_bit_exact(tiny_dir, tmp_path, where) -> None:
    a = trained(tiny_dir)
    location = {"host": HOST, "directory": str(tmp_path / "state"), "file-uri": f"file://{tmp_path}/state",
                "memory-uri": f"memory://test-state/{tmp_path.name}"}[where]
    before = HostCopy.capture(a)
    state = TrainingState.of(a)
    assert state.location == DEVICE
    if where == "host":  # the copy a prefetch leaves: in host memory, no trainer holds it
        state = TrainingState("solver", HOST, copy=HostCopy.capture(a))
    else:
        state.to(location)
        assert state.location == location and state.trainer is None and state.stored_bytes > before.nbytes
    expected_draws = torch.rand(4)  # what the RNG gives right after the state was taken
    torch.manual_seed(12345)  # another agent's work in between moves the process RNG

    b = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0)  # another worker: v0 weights, empty optimizer
    state.to(DEVICE, trainer=b)
    assert state.trainer is b and b.version == 1
    assert same_state(before, HostCopy.capture(b))  # weights, moments, step counts, scheduler, version, RNG
    assert torch.equal(torch.rand(4), expected_draws)  # the RNG continues where it was taken

    batch = make_batch(tiny_dir, [0.5, -0.5, 1.0])
    ra, rb = a.train_step(batch), b.train_step(batch)  # a still has its tensors: the reference
    assert ra.metrics["lr"] == rb.metrics["lr"] == pytest.approx(1e-3 / 3)  # warm-up step 1 of 3
    assert same_state(HostCopy.capture(a), HostCopy.capture(b))


def test_a_state_at_a_uri_is_found_by_a_new_handle(tiny_dir, tmp_path) -> None:
    a = trained(tiny_dir)
    before = HostCopy.capture(a)
    TrainingState.of(a).to(tmp_path / "solver")
    prefetched = TrainingState.at("solver", tmp_path / "solver").to(HOST)  # read ahead, no trainer yet
    assert prefetched.copy is not None and prefetched.trainer is None
    b = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0)
    prefetched.to(DEVICE, trainer=b)
    assert same_state(before, HostCopy.capture(b))


def test_live_host_device_round_trip_keeps_the_state(tiny_dir) -> None:
    a = trained(tiny_dir)
    before = HostCopy.capture(a)
    state = TrainingState.of(a).to(HOST).to(DEVICE)
    assert state.trainer is a and state.location == DEVICE
    assert same_state(before, HostCopy.capture(a))
    a.train_step(make_batch(tiny_dir, [1.0, -1.0]))  # still trains after the moves
    assert a.version == 2


def test_a_state_of_another_agent_is_refused(tiny_dir, tmp_path) -> None:
    TrainingState.of(trained(tiny_dir)).to(tmp_path / "state")
    verifier = AgentTrainer("verifier", tiny_dir, CONFIG, temperature=1.0)
    with pytest.raises(ValueError, match="belongs to agent 'solver', not 'verifier'"):
        TrainingState.at("verifier", tmp_path / "state").to(DEVICE, trainer=verifier)


def test_missing_or_unreachable_states_are_clear_errors(tiny_dir, tmp_path) -> None:
    b = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0)
    with pytest.raises(FileNotFoundError, match=r"no training state at .*nowhere: state.json is missing"):
        TrainingState.at("solver", tmp_path / "nowhere").to(DEVICE, trainer=b)
    with pytest.raises(ValueError, match="goes onto a device through a trainer: pass trainer="):
        TrainingState.at("solver", tmp_path / "nowhere").to(DEVICE)


def test_a_state_in_the_middle_of_an_update_does_not_move(tiny_dir, tmp_path) -> None:
    a = trained(tiny_dir)
    a.accumulate(make_batch(tiny_dir, [1.0, -1.0]))  # half a step: the gradient sum is not in the state
    with pytest.raises(RuntimeError, match="middle of the update to v2"):
        TrainingState.of(a).to(tmp_path / "state")


def test_a_scheduler_mismatch_is_refused(tiny_dir, tmp_path) -> None:
    TrainingState.of(trained(tiny_dir)).to(tmp_path / "state")
    plain = AgentTrainer("solver", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    with pytest.raises(ValueError, match="same training.lr_warmup_steps"):
        TrainingState.at("solver", tmp_path / "state").to(DEVICE, trainer=plain)


def test_swap_benchmark_reports_every_leg_and_a_bit_exact_round_trip(model_cache) -> None:
    from flexmarl.bench.swap_bench import LEGS, bench_swap

    report = bench_swap(["tiny"], log=lambda _: None)
    tiny = report["models"]["tiny"]
    assert report["bit_exact"] and tiny["bit_exact"] and tiny["device"] == report["device"] == "cpu"
    params = AgentTrainer("x", resolve_model("tiny"), TrainerConfig(), temperature=1.0).model.parameters()
    assert tiny["state_bytes"] >= 3 * sum(p.numel() * 4 for p in params)  # weights + two Adam moments
    assert tiny["object_store"] == "memory" and tiny["pinned"] is False
    for leg in LEGS:
        assert tiny[f"{leg}_s"] > 0 and tiny[f"{leg}_gb_per_s"] > 0
    # a LoRA adapter agent's state: its adapter and Adam moments only, a small part of the full state, as exact
    lora = report["adapters"]["tiny"]
    assert lora["r"] == 8 and lora["bit_exact"] and 0 < lora["state_bytes"] < tiny["state_bytes"] / 5


def test_state_moves_take_host_buffers_from_the_pool_and_give_them_back(tiny_dir, monkeypatch) -> None:
    """A GPU worker's pool keeps buffers given back (pinned there): a park to host after a resume takes the
    same buffers again, allocating nothing, and the round trips stay bit-exact."""
    pool = HostPool(pin=False, keep=True)
    monkeypatch.setattr(state_module, "HOST_POOL", pool)
    a = trained(tiny_dir)
    before = HostCopy.capture(a)

    def moved() -> list[torch.Tensor]:  # what a move carries: weights and moments (the step counts stay)
        return [*a.params.values(), *(v for s in a.optimizer.state.values() for v in s.values() if v.dim() > 0)]

    state = TrainingState.of(a).to(HOST)
    parked, allocated = {t.data_ptr() for t in moved()}, pool.allocated_bytes
    state.to(DEVICE)
    assert pool.free_bytes == sum(t.numel() * t.element_size() for t in moved())
    state.to(HOST)
    assert {t.data_ptr() for t in moved()} == parked and pool.allocated_bytes == allocated
    state.to(DEVICE)
    assert same_state(before, HostCopy.capture(a))


def test_a_copy_applied_onto_host_memory_gives_back_only_what_the_trainer_did_not_keep(tiny_dir, monkeypatch) -> None:
    """A trainer on host memory keeps the optimizer tensors it is given (torch's load_state_dict does not copy
    them there): those must not go back to the pool, or the next move would write over the trainer's moments."""
    pool = HostPool(pin=False, keep=True)
    monkeypatch.setattr(state_module, "HOST_POOL", pool)
    b = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0)
    HostCopy.capture(trained(tiny_dir)).apply(b)
    with monkeypatch.context() as m:  # a copy in buffers of its own, none of the pool's
        m.setattr(state_module, "HOST_POOL", HostPool(pin=False, keep=False))
        expected = HostCopy.capture(b)
    for t in [*expected.weights.values(), *expected.optimizer.values()]:
        pool.take(t).fill_(7.0)  # the next moves' buffers, written
    assert same_state(expected, HostCopy.capture(b))
