"""What this machine allows a model's decoding: a roofline of one decode step, from measured throughput.

One decode step of a batch of ``batch`` sequences multiplies each new token through every linear layer (2
FLOPs per weight per sequence, plus attention over the context so far) and reads every weight once for the
whole batch. So the step takes at least the longer of ``flops / matmul rate`` and ``weight bytes / memory
bandwidth``, and tokens/s is at most ``batch`` over that. Both rates are measured here, in this process, with
torch's threads as they are (one per worker in a run), so the limit is that of one worker. A backend's
measured tokens/s over this limit says how much of the machine its decode loop uses.

That roofline assumes the matrix products stream the weights at copy speed. With a handful of rows per
weight, they do not: one thread's BLAS pulls weights from memory several times slower than a copy (2-7 GB/s
against a copy's 20 here, for SmolLM2 at batches 64 to 8). So ``linear_step_s`` also times what one decode step's
linear layers alone take, each of the model's own weights once, in order, on ``batch`` rows: the limit a
backend on this BLAS meets before attention, sampling and Python add theirs (``kernel_tokens_per_s``).

Example:
    >>> limit = decode_limit(resolve_model("smollm2-135m-instruct"), batch=16, context=64)
    >>> limit["tokens_per_s"], limit["bound"]          # e.g. (190.0, 'compute')
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from flexmarl.models.loading import load_model

MATMUL_DIM = 1024  # square float32 matmuls: large enough to run at the BLAS kernel's rate
COPY_BYTES = 256 * 2**20  # larger than any cache


def matmul_flops_per_s(dim: int = MATMUL_DIM, seconds: float = 1.0) -> float:
    """Float32 matmul throughput (FLOP/s) of torch's threads here: the best of repeated timings."""
    a, b = torch.randn(dim, dim), torch.randn(dim, dim)
    torch.mm(a, b)  # warm up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * dim**3 / best


def memory_bytes_per_s(nbytes: int = COPY_BYTES, seconds: float = 1.0) -> float:
    """Memory bandwidth (bytes read and written per second) of a large tensor copy: the best of repeats."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def model_costs(model_dir: str | Path) -> dict:
    """Per decoded token of one sequence, the FLOPs of the linear layers (the vocabulary projection too), and
    the bytes of weights a decode step reads (tied weights once)."""
    return _costs(load_model(model_dir))


def _costs(model: torch.nn.Module) -> dict:
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    unique = {id(p): p for p in model.parameters()}.values()
    cfg = model.config
    return {
        "linear_flops_per_token": 2 * linear,
        "weight_bytes": sum(p.numel() * p.element_size() for p in unique),
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
    }


@torch.no_grad()
def linear_step_seconds(model: torch.nn.Module, batch: int, seconds: float = 1.0) -> float:
    """One decode step's linear layers alone: every ``Linear`` of ``model`` once, in module order, on ``batch``
    rows, the best of repeated timings. A large model's weights do not fit in any cache, so they stream from
    memory as in a real step; a tiny model's stay cached, as they do when it decodes."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {m.in_features: torch.randn(batch, m.in_features) for m in linears}

    def step() -> None:
        for m in linears:
            m(rows[m.in_features])

    step()  # warm up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            return best


def decode_limit(model_dir: str | Path, *, batch: int, context: int, seconds: float = 1.0) -> dict:
    """The tokens/s a decode step of ``batch`` sequences at ``context`` tokens of context can reach here.

    Returns ``tokens_per_s`` (the roofline), ``bound`` ('compute' or 'memory'), both limits, and the measured
    ``matmul_gflops`` and ``memory_gb_s`` it rests on; and ``kernel_tokens_per_s``, ``batch`` over
    ``linear_step_s`` (the step's linear layers timed alone), with ``linear_gb_s``, the weight bytes they read
    per second.
    """
    model = load_model(model_dir).eval()
    costs = _costs(model)
    # attention: q.k and the weighted sum of values over the context, 2 FLOPs each per hidden unit and layer
    flops_per_token = costs["linear_flops_per_token"] + 4 * costs["layers"] * costs["hidden"] * context
    flops, bandwidth = matmul_flops_per_s(seconds=seconds), memory_bytes_per_s(seconds=seconds)
    compute = flops / flops_per_token
    memory = batch * bandwidth / costs["weight_bytes"]
    linear_s = linear_step_seconds(model, batch, seconds=seconds)
    return {
        "tokens_per_s": min(compute, memory),
        "bound": "compute" if compute <= memory else "memory",
        "compute_tokens_per_s": compute,
        "memory_tokens_per_s": memory,
        "matmul_gflops": flops / 1e9,
        "memory_gb_s": bandwidth / 1e9,
        "linear_step_s": linear_s,
        "kernel_tokens_per_s": batch / linear_s,
        "linear_gb_s": costs["weight_bytes"] / linear_s / 1e9,
        "flops_per_token": flops_per_token,
        "weight_bytes": costs["weight_bytes"],
        "batch": batch,
        "context": context,
        "torch_threads": torch.get_num_threads(),
    }
