"""Rollout throughput of the generation backends: tokens per second at a fixed batch.

vLLM usually lives in its own environment (``.venv-vllm``, ``make setup-vllm``), since it pins other
versions of torch and transformers. So ``compare_backends`` measures the hf backend in this process and, when
this Python lacks vllm, runs this module with ``.venv-vllm/bin/python`` and reads its JSON:

    python -m flexmarl.bench.backend_bench --backend vllm --model tiny-large     # prints one JSON object

Each measurement loads the model (``startup_s``), generates one batch to warm up (``first_batch_s``: vLLM
compiles kernels then), then times ``repeats`` batches of ``batch`` prompts of ``prompt_len`` tokens with up
to ``new_tokens`` new tokens each, sampled at temperature 1. ``tokens_per_s`` counts the tokens generated
(a response may end early at its end-of-sequence token) over the timed batches. For the hf backend,
``sampler_share`` is the share of a decode step that sampling takes (``sampler_seconds`` over the step's time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flexmarl.bench.decode_limit import decode_limit
from flexmarl.bench.timing import timed
from flexmarl.models.loading import ModelError, load_model, load_tokenizer, resolve_model
from flexmarl.rollout.backend import GenerationRequest
from flexmarl.rollout.config import Decode, VLLMSettings, vllm_installed
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.rollout.sampling import SeededSampler
from flexmarl.rollout.vllm_backend import VLLMBackend

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def _requests(
    model_dir: Path, batch: int, prompt_len: int, new_tokens: int, round_: int, group: int = 1
) -> list[GenerationRequest]:
    """``batch`` requests of random prompts; with ``group`` > 1, each prompt is asked ``group`` times with
    different seeds, as a GRPO group is (``batch`` must be a multiple of ``group``)."""
    if batch % group:
        raise ValueError(f"batch {batch} is not a multiple of group {group}")
    tok = load_tokenizer(model_dir)
    specials = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in specials]
    g = torch.Generator().manual_seed(round_)
    picks = torch.randint(0, len(vocab), (batch // group, prompt_len), generator=g).tolist()
    return [
        GenerationRequest(f"b{round_}_{i}", [vocab[j] for j in picks[i // group]], new_tokens, 1.0,
                          seed=round_ * batch + i)
        for i in range(batch)
    ]


def backend_throughput(
    backend: str, model: str, batch: int = 16, new_tokens: int = 64, *, prompt_len: int = 32, repeats: int = 3,
    group: int = 1, decode: Decode = "dynamic",
) -> dict:
    """Measure one backend in this process (the hf backend with its decode step run as ``decode``). Returns
    ``{"tokens_per_s": float, ...}`` (see the module doc)."""
    model_dir = resolve_model(model)
    start = time.perf_counter()
    if backend == "hf":
        engine = HFBackend(model_dir, decode=decode)
    elif backend == "vllm":
        engine = VLLMBackend(model_dir, settings=VLLMSettings()).start()
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'hf' or 'vllm'")
    startup_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        engine.generate(_requests(model_dir, batch, prompt_len, new_tokens, 0, group))
        first_batch_s = time.perf_counter() - start
        tokens, seconds, steps = 0, 0.0, 0
        for round_ in range(1, repeats + 1):
            requests = _requests(model_dir, batch, prompt_len, new_tokens, round_, group)
            start = time.perf_counter()
            results = engine.generate(requests)
            seconds += time.perf_counter() - start
            tokens += sum(len(r.response_ids) for r in results)
            steps += max(len(r.response_ids) for r in results)
    finally:
        if isinstance(engine, VLLMBackend):
            engine.close()
    sampler = {}
    if backend == "hf":
        vocab = engine.model.get_output_embeddings().weight.shape[0]
        per_step = sampler_seconds(batch, vocab, engine.device)
        # a step's time here includes its share of the prefill: the share is a little low
        sampler = {"sampler_s_per_step": per_step, "sampler_share": per_step / (seconds / steps)}
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "startup_s": startup_s,
        "first_batch_s": first_batch_s,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "group": group,
        "repeats": repeats,
        "model": model,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        **({"decode": decode} if backend == "hf" else {}),
        **sampler,
    }


def generate_throughput(model: str, batch: int = 16, new_tokens: int = 64, *, prompt_len: int = 32, group: int = 1,
                        repeats: int = 2) -> dict:
    """Plain ``model.generate`` on the hf backend's device (transformers' own loop: unseeded sampling at
    temperature 1, no top-k or top-p, every response ``new_tokens`` long) on ``_requests``' prompts: the
    reference the hf backend is held against."""
    model_dir = resolve_model(model)
    device = HFBackend.default_device()
    lm = load_model(model_dir).to(device).eval()
    pad_id = load_tokenizer(model_dir).pad_token_id

    @torch.no_grad()
    def run(round_: int) -> None:
        requests = _requests(model_dir, batch, prompt_len, new_tokens, round_, group)
        prompts = torch.tensor([r.prompt_ids for r in requests], device=device)
        lm.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
                    top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)

    run(0)  # warm-up
    seconds = sum(timed(lambda r=round_: run(r)) for round_ in range(1, repeats + 1))
    tokens = batch * new_tokens * repeats
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "batch": batch,
            "new_tokens": new_tokens, "prompt_len": prompt_len, "group": group, "repeats": repeats,
            "device": device.type}


def sampler_seconds(batch: int, vocab: int, device: torch.device, *, repeats: int = 20) -> float:
    """Median seconds of one ``SeededSampler`` draw for ``batch`` rows of ``vocab`` logits at temperature 1:
    the hf backend's sampling work per decode step, without the model."""
    sampler = SeededSampler(range(batch), vocab=vocab, device=device)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    times = [timed(lambda s=step: sampler(logits, step=s, temperature=1.0)) for step in range(repeats + 1)]
    return statistics.median(times[1:])  # the first is a warm-up


def vllm_in_subprocess(
    model: str, batch: int, new_tokens: int, *, python: Path = VLLM_PYTHON, timeout_s: float = 1200, group: int = 1
) -> dict:
    """Run the vllm measurement with another environment's Python; ``{"unavailable": reason}`` if it cannot."""
    if not python.exists():
        return {"unavailable": f"vllm is not installed here and {python} does not exist (run `make setup-vllm`)"}
    cmd = [str(python), "-m", "flexmarl.bench.backend_bench", "--backend", "vllm", "--model", model,
           "--batch", str(batch), "--new-tokens", str(new_tokens), "--group", str(group)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"unavailable": f"the vllm benchmark did not finish within {timeout_s:.0f}s"}
    if done.returncode != 0:
        return {"unavailable": f"the vllm benchmark failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"}
    # vLLM logs to stdout too: the result is the last line that is a JSON object
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"unavailable": f"the vllm benchmark printed no result: {done.stdout.strip()[-500:]}"}


def compare_backends(model: str, batch: int = 16, new_tokens: int = 64, *, vllm_python: Path = VLLM_PYTHON,
                     prompt_len: int = 32, group: int = 1, decode: Decode = "dynamic") -> dict:
    """``{"model", "batch", "new_tokens", "limit": {...}, "backends": {"hf": {"tokens_per_s", "share_of_limit",
    "share_of_kernel", ...}, "vllm": {...} or {"unavailable": reason}}}``; ``limit`` is what this machine allows
    the model's decoding at that batch (``decode_limit``), ``share_of_limit`` each backend's tokens/s over its
    roofline and ``share_of_kernel`` over its linear layers timed alone. ``decode``: the hf backend's decode
    step (``rollout.decode``)."""
    limit = decode_limit(resolve_model(model), batch=batch, context=prompt_len + new_tokens // 2)
    hf = backend_throughput("hf", model, batch, new_tokens, prompt_len=prompt_len, group=group, decode=decode)
    if vllm_installed():
        try:
            vllm = backend_throughput("vllm", model, batch, new_tokens, group=group)
        except Exception as exc:  # noqa: BLE001 - reported, e.g. a head size vLLM's CPU attention lacks
            vllm = {"unavailable": f"{type(exc).__name__}: {exc}"}
    else:
        vllm = vllm_in_subprocess(model, batch, new_tokens, python=vllm_python, group=group)
    for result in (hf, vllm):
        if "tokens_per_s" in result:
            result["share_of_limit"] = result["tokens_per_s"] / limit["tokens_per_s"]
            result["share_of_kernel"] = result["tokens_per_s"] / limit["kernel_tokens_per_s"]
    return {"model": model, "batch": batch, "new_tokens": new_tokens, "group": group, "limit": limit,
            "backends": {"hf": hf, "vllm": vllm}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokens per second of one rollout backend (prints JSON).")
    parser.add_argument("--backend", choices=["hf", "vllm"], required=True)
    parser.add_argument("--model", default="tiny-large", help="a model setting (see flexmarl.models.loading)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group", type=int, default=1, help="requests per prompt (a GRPO group)")
    args = parser.parse_args(argv)
    try:
        result = backend_throughput(args.backend, args.model, args.batch, args.new_tokens, repeats=args.repeats,
                                    group=args.group)
    except ModelError as exc:  # a model this backend cannot run here, e.g. a head size vLLM's CPU attention lacks
        result = {"unavailable": str(exc)}
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
