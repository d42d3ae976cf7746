from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from flexmarl.rollout.backend import GenerationRequest, WeightSyncError, WeightUpdate
from flexmarl.rollout.hf_backend import HFBackend


def test_generates_batched_responses_with_logprobs(tiny_dir) -> None:
    backend = HFBackend(tiny_dir)
    reqs = [GenerationRequest(f"r{i}", [257] + [65] * i, 8, 1.0, seed=1) for i in range(1, 5)]
    results = backend.generate(reqs)
    assert [r.request_id for r in results] == ["r1", "r2", "r3", "r4"]
    for r in results:
        assert (r.response_ids.dtype, r.logprobs.dtype) == (np.int32, np.float32)  # the store's types, as arrays
        assert 1 <= len(r.response_ids) <= 8 and len(r.logprobs) == len(r.response_ids)
        assert all(lp <= 0 for lp in r.logprobs)
        assert r.finish_reason == ("stop" if r.response_ids[-1] == backend.eos_id else "length")
        assert r.policy_version == 0


def test_weight_update_is_validated_before_it_is_applied(tiny_dir) -> None:
    backend = HFBackend(tiny_dir)
    state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    name = next(iter(state))
    bad = dict(state)
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(WeightSyncError, match=f"agent 'a'.*{name}: got \\(3, 3\\)"):
        backend.update_weights(WeightUpdate("a", 1, bad))
    assert backend.version == 0
    assert torch.equal(backend.model.state_dict()[name], state[name])

    changed = {k: v + 1.0 for k, v in state.items()}
    backend.update_weights(WeightUpdate("a", 1, changed))
    assert backend.version == 1
    assert torch.equal(backend.model.state_dict()[name], changed[name])


def test_a_response_depends_on_its_seed_not_on_its_batch(tiny_dir) -> None:
    backend = HFBackend(tiny_dir)
    target = GenerationRequest("t", [257, 70, 71, 72], 12, 1.0, seed=42)
    others = [GenerationRequest(f"o{i}", [257] + [80 + i] * (i + 1), 12, 1.0, seed=i) for i in range(5)]
    alone = backend.generate([target])[0]
    batched = {r.request_id: r for r in backend.generate(others[:2] + [target] + others[2:])}["t"]
    assert batched.response_ids.tolist() == alone.response_ids.tolist()
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    reseeded = backend.generate([GenerationRequest("t", target.prompt_ids, 12, 1.0, seed=43)])[0]
    assert reseeded.response_ids.tolist() != alone.response_ids.tolist()


def test_requests_with_one_prompt_share_its_prefill_and_answer_as_if_alone(tiny_dir) -> None:
    """A GRPO group's samples (one prompt, several seeds) run the prompt once, and the head all prompts share
    runs once; each row still answers as it would alone, beside a request with another prompt of another
    length."""
    backend = HFBackend(tiny_dir)
    group = [GenerationRequest(f"g{i}", [257, 60, 61, 62, 70, 71, 72], 10, 1.0, seed=i) for i in range(4)]
    other = GenerationRequest("o", [257, 60, 61, 62, 90, 91, 92, 93, 94, 95], 10, 1.0, seed=9)
    calls = []
    hook = backend.model.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                               with_kwargs=True)
    together = {r.request_id: r for r in backend.generate([group[0], other, *group[1:]])}
    hook.remove()
    assert calls[:2] == [(1, 4), (2, 6)]  # the shared head, then each distinct prompt's rest, left-padded
    assert all(shape == (5, 1) for shape in calls[2:])  # every decode step: one row per request
    for request in [*group, other]:
        alone = backend.generate([request])[0]
        assert together[request.request_id].response_ids.tolist() == alone.response_ids.tolist()
        assert together[request.request_id].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert len({tuple(together[r.request_id].response_ids) for r in group}) > 1  # the seeds still differ


@pytest.mark.parametrize("decode", ["static", pytest.param("compiled", marks=pytest.mark.skipif(
    shutil.which("c++") is None, reason="torch.compile on a CPU needs a C++ compiler"))])
def test_a_static_cache_and_a_compiled_step_draw_the_dynamic_caches_tokens(tiny_dir, decode) -> None:
    """Prompts of several lengths (left-padded): every row's tokens as with transformers' own cache; log-probs
    up to float rounding (attention over the longer static cache, and the compiled step's fused kernels, sum in
    another order)."""
    reqs = [GenerationRequest(f"r{i}", [257, 60, 61, 62, *range(70, 70 + i % 4)], 10, 1.0, seed=i) for i in range(6)]
    dynamic = HFBackend(tiny_dir).generate(reqs)
    other = HFBackend(tiny_dir, decode=decode)
    for _ in range(2):  # the second batch reuses the static cache's length and the compiled step
        for a, b in zip(dynamic, other.generate(reqs), strict=True):
            assert a.response_ids.tolist() == b.response_ids.tolist()
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
