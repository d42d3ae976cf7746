from __future__ import annotations

import pytest
import torch

from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.training.config import TrainerConfig
from flexmarl.training.trainer import AgentTrainer, TrainBatch


def make_batch(tiny_dir, advantages: list[float]) -> TrainBatch:
    backend = HFBackend(tiny_dir)
    reqs = [GenerationRequest(f"s{i}", [257, 10 + i, 20, 30], 6, 1.0, seed=i) for i in range(len(advantages))]
    res = backend.generate(reqs)
    return TrainBatch(
        sample_ids=[r.request_id for r in res],
        prompt_ids=[q.prompt_ids for q in reqs],
        response_ids=[r.response_ids for r in res],
        logprobs=[r.logprobs for r in res],
        advantages=advantages,
    )


def params(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.weights().items()}


def test_rollout_logprobs_equal_the_trainers_scores(tiny_dir) -> None:
    """The trainer must score exactly the distribution the replica sampled from (ratio 1 on-policy)."""
    from flexmarl.training.trainer import response_logprobs

    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5])
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(), temperature=1.0)
    with torch.no_grad():
        logp, mask = response_logprobs(trainer.model, batch, 1.0, torch.device("cpu"))
    for i, lp in enumerate(batch.logprobs):
        assert logp[i, : len(lp)].tolist() == pytest.approx(lp, abs=1e-4)
        assert mask[i].sum() == len(lp)


def test_update_moves_weights_and_bumps_version(tiny_dir) -> None:
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3, micro_batch_size=2), temperature=1.0)
    before = params(trainer)
    result = trainer.train_step(make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5]))
    assert result.policy_version == trainer.version == 1 and not result.skipped
    assert result.consumed_ids == ["s0", "s1", "s2", "s3"]
    assert result.metrics["micro_batches"] == 2
    after = trainer.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_zero_advantages_leave_weights_unchanged(tiny_dir) -> None:
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    before = params(trainer)
    trainer.train_step(make_batch(tiny_dir, [0.0, 0.0]))
    after = trainer.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nan_loss_skips_the_update(tiny_dir) -> None:
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    before = params(trainer)
    result = trainer.train_step(make_batch(tiny_dir, [float("nan"), 1.0]))
    assert result.skipped and result.policy_version == 0 and trainer.version == 0
    after = trainer.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
