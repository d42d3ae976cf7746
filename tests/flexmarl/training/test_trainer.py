from __future__ import annotations

import math

import pytest
import torch

from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.training.config import TrainerConfig
from flexmarl.training.trainer import AgentTrainer, TrainBatch


def make_batch(tiny_dir, advantages: list[float], temperature: float = 1.0) -> TrainBatch:
    backend = HFBackend(tiny_dir)
    reqs = [GenerationRequest(f"s{i}", [257, 10 + i, 20, 30], 6, temperature, seed=i) for i in range(len(advantages))]
    res = backend.generate(reqs)
    return TrainBatch(
        sample_ids=[r.request_id for r in res],
        prompt_ids=[q.prompt_ids for q in reqs],
        response_ids=[r.response_ids for r in res],
        logprobs=[r.logprobs for r in res],
        advantages=advantages,
        versions=[0] * len(advantages),
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
        assert logp[i, : len(lp)].tolist() == pytest.approx(lp.tolist(), abs=1e-4)
        assert mask[i].sum() == len(lp)


def test_older_transformers_one_index_for_all_rows_scores_the_same(tiny_dir, monkeypatch) -> None:
    """The vLLM environment's transformers takes one 1-D logits_to_keep for a batch: same scores that way."""
    from flexmarl.training import trainer as trainer_module

    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5])
    batch = TrainBatch(batch.sample_ids, [[257] * i + p for i, p in enumerate(batch.prompt_ids)],  # rows differ
                       batch.response_ids, batch.logprobs, batch.advantages, batch.versions)
    model = AgentTrainer("a", tiny_dir, TrainerConfig(), temperature=1.0).model
    with torch.no_grad():
        per_row = trainer_module.response_logprobs(model, batch, 1.0, torch.device("cpu"))
        monkeypatch.setattr(trainer_module, "_KEEPS_PER_ROW", False)
        union = trainer_module.response_logprobs(model, batch, 1.0, torch.device("cpu"))
    assert torch.equal(per_row[1], union[1]) and torch.allclose(per_row[0], union[0], atol=1e-6)


def test_shared_prompt_tokens_run_once_and_score_and_backpropagate_as_one_sequence_per_sample(tiny_dir) -> None:
    """Two GRPO groups (prompts of different lengths sharing a head, answers of different lengths, one of a
    single token): the shared-prompt path gives the rollout's log-probs, and the same scores and gradients as
    running each sample's whole sequence."""
    from flexmarl.training import trainer as trainer_module

    backend = HFBackend(tiny_dir)
    prompts = [[257, 5, 6, 7, 11, 20, 30], [257, 5, 6, 7, 12, 21, 31, 41, 51]]
    reqs = [GenerationRequest(f"s{g}{i}", prompts[g], 6, 0.8, seed=10 * g + i) for g in range(2) for i in range(3)]
    res = backend.generate(reqs)
    responses = [r.response_ids for r in res]
    responses[1] = responses[1][:1]  # a one-token answer
    batch = TrainBatch([q.request_id for q in reqs], [q.prompt_ids for q in reqs], responses,
                       [r.logprobs[: len(t)] for r, t in zip(res, responses, strict=True)],
                       [1.0, -1.0, 0.5, -0.5, 2.0, -2.0], [0] * 6)
    model = AgentTrainer("a", tiny_dir, TrainerConfig(), temperature=0.8).model
    calls = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                       with_kwargs=True)

    shared_logp, mask = trainer_module.response_logprobs(model, batch, 0.8, torch.device("cpu"))
    hook.remove()
    assert calls == [(1, 4), (2, 5), (6, 5)]  # the shared head, each prompt's rest, every answer but its last token
    (shared_logp * mask * torch.tensor(batch.advantages)[:, None]).sum().backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    full = trainer_module.full_sequence_logits(model, batch, torch.device("cpu"))
    targets = torch.zeros_like(mask, dtype=torch.long)
    for i, r in enumerate(batch.response_ids):
        targets[i, : len(r)] = r
    full_logp = torch.log_softmax(full.float() / 0.8, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (full_logp * mask * torch.tensor(batch.advantages)[:, None]).sum().backward()
    assert torch.allclose(shared_logp * mask, full_logp * mask, atol=1e-5)
    for i, lp in enumerate(batch.logprobs):
        assert shared_logp[i, : len(lp)].tolist() == pytest.approx(lp.tolist(), abs=1e-4)
    assert shared_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in shared_grads.items():
        assert torch.allclose(grad, model.get_parameter(name).grad, atol=1e-5), name


def test_rollout_logprobs_equal_the_trainers_scores_at_temperature_0_7(tiny_dir) -> None:
    """At T != 1 a missing or doubled 1/T on either side shows (at T = 1 it cannot)."""
    from flexmarl.training.trainer import response_logprobs

    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5], temperature=0.7)
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(), temperature=0.7)
    with torch.no_grad():
        logp, _ = response_logprobs(trainer.model, batch, trainer.temperature, torch.device("cpu"))
        at_one, _ = response_logprobs(trainer.model, batch, 1.0, torch.device("cpu"))
    for i, lp in enumerate(batch.logprobs):
        assert logp[i, : len(lp)].tolist() == pytest.approx(lp.tolist(), abs=1e-4)
    worst_at_one = max(max(abs(a - b) for a, b in zip(at_one[i, : len(lp)].tolist(), lp.tolist())) for i, lp in
                       enumerate(batch.logprobs))
    assert worst_at_one > 1e-2  # scoring at T = 1 would be caught
    # on-policy, the trainer's importance weights are the identity
    trainer.begin_step()
    trainer.accumulate(batch)
    metrics = trainer.finish_step().metrics
    assert metrics["policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["policy/is_weight_at_cap"] == 0.0 and metrics["policy/clipfrac"] == 0.0


def step_gradient(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    """Spy on the trainer's optimizer: the gradient its next ``step`` is handed (filled in when it runs)."""
    seen: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step
    model = trainer.accelerator.unwrap_model(trainer.model)

    def spy(*args, **kwargs):
        seen.update({n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = spy
    return seen


def reference_gradient(tiny_dir, batch: TrainBatch, *, loss_type: str, temperature: float, max_new_tokens: int,
                       is_cap: float) -> dict[str, torch.Tensor]:
    """The full-batch GRPO-family gradient, written out on its own: one response at a time, no padding.

    With one optimizer step per batch the ratio to the proximal policy is 1, so the gradient of each token is
    -A * w * grad(log p), where w = min(p / p_behaviour, is_cap) corrects from the rollout's policy.
    """
    from flexmarl.models.loading import load_model

    model = load_model(tiny_dir)
    per_response = []
    for prompt, response, behaviour, adv in zip(batch.prompt_ids, batch.response_ids, batch.logprobs,
                                                batch.advantages, strict=True):
        ids = torch.tensor([prompt + response.tolist()])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]  # (T, V)
        logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, response.long()[:, None])[:, 0]
        w = torch.exp(logp.detach() - behaviour).clamp(max=is_cap)
        per_response.append((-adv * w * logp).sum() / (len(response) if loss_type == "grpo" else 1))
    total = torch.stack(per_response).sum()
    denom = {"grpo": len(batch), "dapo": batch.num_tokens, "dr_grpo": len(batch) * max_new_tokens}[loss_type]
    (total / denom).backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_update_applies_the_reference_gradient(tiny_dir, loss_type: str) -> None:
    """The gradient handed to the optimizer, micro-batch by micro-batch, equals the one written out by hand.

    Comparing weights after an AdamW step would not do: Adam's first step hardly sees the gradient's scale,
    so a wrong normaliser (x7) or a wrong ``max_new_tokens`` for dr_grpo would pass. The behaviour log-probs
    are shifted as a bf16 rollout engine might: fresh samples still get their (capped) gradient instead of a
    clipped one.
    """
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5, 2.0], temperature=0.7)
    shift = {(0, 0): 0.5, (1, 1): 0.5, (2, 0): -0.5, (4, 0): 1.0, (4, 1): 1.5}  # p/p_behaviour = e^shift
    logprobs = [lp.tolist() for lp in batch.logprobs]
    for (i, t), d in shift.items():
        logprobs[i][t] -= d
    batch = TrainBatch(batch.sample_ids, batch.prompt_ids, batch.response_ids, logprobs, batch.advantages,
                       batch.versions)
    config = TrainerConfig(loss_type=loss_type, lr=1e-3, micro_batch_size=2, max_grad_norm=None, is_cap=2.0)
    trainer = AgentTrainer("a", tiny_dir, config, temperature=0.7, max_new_tokens=24)  # 24 > every length (6)
    seen = step_gradient(trainer)
    result = trainer.train_step(batch)
    expected = reference_gradient(tiny_dir, batch, loss_type=loss_type, temperature=0.7, max_new_tokens=24,
                                  is_cap=2.0)
    assert result.metrics["micro_batches"] == 3 and set(seen) == set(expected)
    scale = max(float(g.abs().max()) for g in expected.values())
    assert max(float((seen[n] - expected[n]).abs().max()) for n in expected) <= 1e-4 * scale
    # two of the shifted tokens sit above the cap (e^1, e^1.5 > 2); the weight of the rest is ~1
    assert result.metrics["policy/is_weight_at_cap"] == pytest.approx(2 / batch.num_tokens)
    weights = [min(math.exp(shift.get((i, t), 0.0)), 2.0)
               for i, r in enumerate(batch.response_ids) for t in range(len(r))]
    assert result.metrics["policy/is_weight_mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-4)


def test_a_step_with_nothing_to_train_advances_the_version_only(tiny_dir) -> None:
    """Every sample of the global batch dropped (dynamic sampling) or failed: no optimizer step, no error."""
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3, lr_warmup_steps=2), temperature=1.0)
    before = params(trainer)
    result = trainer.finish_step()  # not even begun: no micro-batch reached the trainer
    assert (result.policy_version, result.consumed_ids, result.num_tokens, result.skipped) == (1, [], 0, False)
    assert result.metrics == {"micro_batches": 0.0} and not trainer.step_under_way
    trainer.begin_step()
    assert trainer.finish_step().policy_version == 2  # begun, but nothing accumulated
    after = trainer.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0  # no Adam step, no warm-up step
    result = trainer.train_step(make_batch(tiny_dir, [1.0, -1.0]))
    assert result.policy_version == 3 and result.metrics["micro_batches"] == 1


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
    assert result.skipped and result.consumed_ids == []
    assert result.policy_version == trainer.version == 1  # the batch is spent; versions count batches
    after = trainer.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_pipelined_micro_batches_equal_one_full_batch_step(tiny_dir) -> None:
    """Micro-batches accumulated one by one (another partition, another order) give train_step's update.

    Not bit-equal: different micro-batch shapes round differently in the forward pass.
    """
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5, 0.25])
    whole = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3, micro_batch_size=5), temperature=1.0)
    whole.train_step(batch)
    piped = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    piped.begin_step()
    for start, stop in [(3, 5), (0, 1), (1, 3)]:
        piped.accumulate(batch.slice(start, stop))
    result = piped.finish_step()
    assert result.policy_version == 1 and sorted(result.consumed_ids) == sorted(batch.sample_ids)
    a, b = whole.weights(), piped.weights()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_stale_samples_get_importance_weights(tiny_dir) -> None:
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-3), temperature=1.0)
    trainer.train_step(make_batch(tiny_dir, [1.0, -1.0]))  # now at v1
    stale = make_batch(tiny_dir, [1.0, -1.0])  # generated by v0
    trainer.begin_step()
    stats = trainer.accumulate(stale)
    assert stats["stale_fraction"] == 1.0
    assert trainer.finish_step().policy_version == 2


@pytest.mark.parametrize("adapter", [None, {"r": 4, "alpha": 8}], ids=["full-model", "lora-adapter"])
def test_kl_to_the_frozen_reference_starts_at_zero(tiny_dir, adapter) -> None:
    # an adapter agent's reference is its base with the adapters off
    trainer = AgentTrainer("a", tiny_dir, TrainerConfig(lr=1e-2, kl_coef=0.1, adapter=adapter), temperature=1.0)
    trainer.begin_step()
    assert trainer.accumulate(make_batch(tiny_dir, [1.0, -1.0]))["kl"] == pytest.approx(0.0, abs=1e-6)
    trainer.finish_step()
    trainer.begin_step()
    assert trainer.accumulate(make_batch(tiny_dir, [1.0, -1.0]))["kl"] > 0  # the weights moved away


@pytest.mark.parametrize("adapter", [None, {"r": 4, "alpha": 8}], ids=["full-model", "lora-adapter"])
def test_a_closed_trainer_is_freed_while_the_workers_other_trainer_trains_on(tiny_dir, adapter) -> None:
    import gc
    import weakref

    config = TrainerConfig(lr=1e-2, adapter=adapter)
    other = AgentTrainer("b", tiny_dir, config, temperature=1.0)  # prepared with the same process Accelerator
    trainer = AgentTrainer("a", tiny_dir, config, temperature=1.0)
    trainer.train_step(make_batch(tiny_dir, [1.0, -1.0]))  # Adam moments exist
    held = [weakref.ref(o) for o in (trainer.model, trainer.optimizer, next(iter(trainer.params.values())))]
    trainer.close()
    del trainer
    gc.collect()
    assert [ref() for ref in held] == [None] * 3  # the shared Accelerator held them until close
    before = params(other)
    assert not other.train_step(make_batch(tiny_dir, [1.0, -1.0])).skipped
    assert any(not torch.equal(before[k], v) for k, v in params(other).items())
