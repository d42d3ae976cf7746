"""The rollout backend benchmark at a tiny size: what it counts and reports (speed is never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flexmarl.bench.backend_bench import backend_throughput, compare_backends, vllm_in_subprocess
from flexmarl.rollout.config import vllm_installed


def _check_counts(result: dict, batch: int, new_tokens: int, repeats: int) -> None:
    # Every response has at least one token and at most new_tokens; the rate is over the timed batches only.
    assert repeats * batch <= result["tokens"] <= repeats * batch * new_tokens
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])
    assert (result["batch"], result["new_tokens"], result["repeats"]) == (batch, new_tokens, repeats)


def test_hf_throughput_counts_the_generated_tokens(model_cache) -> None:
    _check_counts(backend_throughput("hf", "tiny", batch=4, new_tokens=8, repeats=2), 4, 8, 2)


def test_an_unknown_backend_is_refused(model_cache) -> None:
    with pytest.raises(ValueError, match="unknown backend 'sglang'"):
        backend_throughput("sglang", "tiny")


@pytest.mark.skipif(vllm_installed(), reason="checks the report where vllm is missing")
def test_without_a_vllm_environment_vllm_is_reported_unavailable(model_cache, tmp_path: Path) -> None:
    report = compare_backends("tiny", batch=2, new_tokens=4, vllm_python=tmp_path / "missing" / "python")
    assert report["backends"]["hf"]["tokens_per_s"] > 0
    assert set(report["backends"]["vllm"]) == {"unavailable"}
    assert "make setup-vllm" in report["backends"]["vllm"]["unavailable"]


@pytest.mark.vllm
def test_the_vllm_measurement_runs_as_a_subprocess_and_prints_json(model_cache) -> None:
    # What the main environment's `flexmarl bench rollout` does with .venv-vllm/bin/python.
    result = vllm_in_subprocess("tiny-large", batch=4, new_tokens=8, python=Path(sys.executable))
    assert "unavailable" not in result, result
    _check_counts(result, 4, 8, 3)
    assert result["model"] == "tiny-large"
