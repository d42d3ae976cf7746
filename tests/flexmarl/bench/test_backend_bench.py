"""The rollout backend benchmark at a tiny size: what it counts and reports (speed is never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torch

from flexmarl.bench.backend_bench import (
    _requests, backend_throughput, compare_backends, generate_throughput, vllm_in_subprocess,
)
from flexmarl.bench.decode_limit import decode_limit, linear_step_seconds, model_costs
from flexmarl.models.loading import load_model, resolve_model
from flexmarl.rollout.config import vllm_installed


def _check_counts(result: dict, batch: int, new_tokens: int, repeats: int) -> None:
    # Every response has at least one token and at most new_tokens; the rate is over the timed batches only.
    assert repeats * batch <= result["tokens"] <= repeats * batch * new_tokens
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])
    assert (result["batch"], result["new_tokens"], result["repeats"]) == (batch, new_tokens, repeats)


def test_hf_throughput_counts_the_generated_tokens(model_cache) -> None:
    result = backend_throughput("hf", "tiny", batch=4, new_tokens=8, repeats=2)
    _check_counts(result, 4, 8, 2)
    assert result["sampler_s_per_step"] > 0 and 0 < result["sampler_share"] < 1


def test_plain_generate_makes_every_response_full_length(model_cache) -> None:
    result = generate_throughput("tiny", batch=4, new_tokens=8, prompt_len=6, repeats=2)
    assert result["tokens"] == 2 * 4 * 8
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])


def test_an_unknown_backend_is_refused(model_cache) -> None:
    with pytest.raises(ValueError, match="unknown backend 'sglang'"):
        backend_throughput("sglang", "tiny")


@pytest.mark.cluster  # a throughput benchmark of the model, and of its roofline (seconds)
@pytest.mark.skipif(vllm_installed(), reason="checks the report where vllm is missing")
def test_without_a_vllm_environment_vllm_is_reported_unavailable(model_cache, tmp_path: Path) -> None:
    report = compare_backends("tiny", batch=2, new_tokens=4, vllm_python=tmp_path / "missing" / "python")
    assert report["backends"]["hf"]["tokens_per_s"] > 0
    assert set(report["backends"]["vllm"]) == {"unavailable"}
    assert "make setup-vllm" in report["backends"]["vllm"]["unavailable"]
    hf, limit = report["backends"]["hf"], report["limit"]
    assert hf["share_of_limit"] == pytest.approx(hf["tokens_per_s"] / limit["tokens_per_s"])
    assert hf["share_of_kernel"] == pytest.approx(hf["tokens_per_s"] / limit["kernel_tokens_per_s"])


def test_the_decode_limit_is_the_slower_of_compute_and_memory(model_cache) -> None:
    costs = model_costs(resolve_model("tiny"))
    model = load_model(resolve_model("tiny"))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert costs["linear_flops_per_token"] == 2 * linear
    assert costs["weight_bytes"] == sum(4 * p.numel() for p in {id(p): p for p in model.parameters()}.values())
    one, many = (decode_limit(resolve_model("tiny"), batch=b, context=16, seconds=0.2) for b in (1, 4096))
    for limit, batch in ((one, 1), (many, 4096)):
        assert limit["tokens_per_s"] == min(limit["compute_tokens_per_s"], limit["memory_tokens_per_s"])
        assert limit["matmul_gflops"] > 0 and limit["memory_gb_s"] > 0
        assert limit["kernel_tokens_per_s"] == pytest.approx(batch / limit["linear_step_s"])
        assert limit["linear_gb_s"] == pytest.approx(costs["weight_bytes"] / limit["linear_step_s"] / 1e9)
    for limit in (one, many):  # the slower of the two, as measured this time (a loaded machine moves both)
        assert limit["bound"] == ("compute" if limit["compute_tokens_per_s"] <= limit["memory_tokens_per_s"]
                                  else "memory")
    # a batch shares each weight read: the tokens a byte moved buys grow with the batch, whatever the speeds
    assert many["memory_tokens_per_s"] / many["memory_gb_s"] > 10 * one["memory_tokens_per_s"] / one["memory_gb_s"]
    # each sequence reads its own KV cache: a key and a value per layer and position
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    assert many["kv_bytes"] == 4096 * 16 * per_position
    assert many["memory_tokens_per_s"] == pytest.approx(
        4096 * many["memory_gb_s"] * 1e9 / (costs["weight_bytes"] + many["kv_bytes"]))
    assert one["flops_per_token"] == costs["linear_flops_per_token"] + 4 * model.config.num_hidden_layers * \
        model.config.hidden_size * 16


def test_the_linear_step_runs_every_linear_layer_once_on_the_batch(model_cache) -> None:
    model = load_model(resolve_model("tiny"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seen = []
    for m in linears:
        m.register_forward_hook(lambda mod, args, out: seen.append((mod, tuple(args[0].shape))))
    assert linear_step_seconds(model, 3, seconds=0) > 0
    assert seen == [(m, (3, m.in_features)) for m in linears] * 2  # the warm-up, then one timed step


@pytest.mark.vllm
def test_the_vllm_measurement_runs_as_a_subprocess_and_prints_json(model_cache) -> None:
    # What the main environment's `flexmarl bench rollout` does with .venv-vllm/bin/python.
    result = vllm_in_subprocess("tiny-large", batch=4, new_tokens=8, python=Path(sys.executable))
    assert "unavailable" not in result, result
    _check_counts(result, 4, 8, 3)
    assert result["model"] == "tiny-large"


def test_grouped_requests_ask_each_prompt_group_times_with_their_own_seeds(model_cache) -> None:
    requests = _requests(resolve_model("tiny"), 8, 5, 4, 1, group=4)
    assert len({tuple(r.prompt_ids) for r in requests}) == 2 and len({r.seed for r in requests}) == 8
    assert [tuple(r.prompt_ids) for r in requests[:4]] == [tuple(requests[0].prompt_ids)] * 4
    with pytest.raises(ValueError, match="batch 6 is not a multiple of group 4"):
        _requests(resolve_model("tiny"), 6, 5, 4, 1, group=4)
    assert backend_throughput("hf", "tiny", batch=4, new_tokens=4, repeats=1, group=2)["group"] == 2
