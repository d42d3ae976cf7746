"""What this machine allows a model's decoding: a roofline of one decode step, from measured throughput.

One decode step of a batch of ``batch`` sequences multiplies each new token through every linear layer (2
FLOPs per weight per sequence, plus attention over the context so far), reads every weight once for the whole
batch, and reads each sequence's KV cache. So the step takes at least the longer of ``flops / matmul rate`` and
``(weight bytes + KV bytes) / memory bandwidth``, and tokens/s is at most ``batch`` over that. Both rates are
measured here, on the device the hf backend decodes on (a GPU where there is one), in the model's dtype, with
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

from pathlib import Path

import torch

from flexmarl.bench.timing import best_seconds
from flexmarl.models.loading import load_model
from flexmarl.rollout.hf_backend import HFBackend

MATMUL_DIM = {"cpu": 1024, "cuda": 8192}  # square matmuls large enough to run at the kernel's rate
COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}  # larger than any cache
CPU = torch.device("cpu")


def matmul_flops_per_s(device: torch.device = CPU, dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    """Matmul throughput (FLOP/s) in ``dtype`` on ``device`` (on a CPU, of torch's threads here)."""
    dim = MATMUL_DIM[device.type]
    a, b = torch.randn(dim, dim, device=device, dtype=dtype), torch.randn(dim, dim, device=device, dtype=dtype)
    return 2 * dim**3 / best_seconds(lambda: torch.mm(a, b), seconds)


def memory_bytes_per_s(device: torch.device = CPU, seconds: float = 1.0) -> float:
    """Memory bandwidth (bytes read and written per second) of a large tensor copy on ``device``."""
    nbytes = COPY_BYTES[device.type]
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), seconds)


def model_costs(model_dir: str | Path) -> dict:
    """Per decoded token of one sequence, the FLOPs of the linear layers (the vocabulary projection too), and
    the bytes of weights a decode step reads (tied weights once)."""
    return _costs(load_model(model_dir))


def _costs(model: torch.nn.Module) -> dict:
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    unique = list({id(p): p for p in model.parameters()}.values())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return {
        "linear_flops_per_token": 2 * linear,
        "weight_bytes": sum(p.numel() * p.element_size() for p in unique),
        # one cached position of one sequence: a key and a value per layer
        "kv_bytes_per_position": 2 * cfg.num_hidden_layers * kv_heads * head_dim * unique[0].element_size(),
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
    }


@torch.no_grad()
def linear_step_seconds(model: torch.nn.Module, batch: int, seconds: float = 1.0) -> float:
    """One decode step's linear layers alone: every ``Linear`` of ``model`` once, in module order, on ``batch``
    rows, on the model's device, the best of repeated timings. A large model's weights do not fit in any cache,
    so they stream from memory as in a real step; a tiny model's stay cached, as they do when it decodes."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    first = linears[0].weight
    rows = {m.in_features: torch.randn(batch, m.in_features, device=first.device, dtype=first.dtype)
            for m in linears}

    def step() -> None:
        for m in linears:
            m(rows[m.in_features])

    return best_seconds(step, seconds)


def decode_limit(model_dir: str | Path, *, batch: int, context: int, seconds: float = 1.0,
                 device: torch.device | None = None) -> dict:
    """The tokens/s a decode step of ``batch`` sequences at ``context`` tokens of context can reach on ``device``
    (by default the hf backend's: a GPU where there is one).

    Returns ``tokens_per_s`` (the roofline), ``bound`` ('compute' or 'memory'), both limits, the bytes a step
    reads (``weight_bytes``, ``kv_bytes``), and the measured ``matmul_gflops`` and ``memory_gb_s`` it rests on;
    and ``kernel_tokens_per_s``, ``batch`` over ``linear_step_s`` (the step's linear layers timed alone), with
    ``linear_gb_s``, the weight bytes they read per second.
    """
    device = device or HFBackend.default_device()
    model = load_model(model_dir).to(device).eval()
    costs = _costs(model)
    dtype = next(model.parameters()).dtype
    # attention: q.k and the weighted sum of values over the context, 2 FLOPs each per hidden unit and layer
    flops_per_token = costs["linear_flops_per_token"] + 4 * costs["layers"] * costs["hidden"] * context
    kv_bytes = batch * context * costs["kv_bytes_per_position"]
    flops = matmul_flops_per_s(device, dtype, seconds=seconds)
    bandwidth = memory_bytes_per_s(device, seconds=seconds)
    compute = flops / flops_per_token
    memory = batch * bandwidth / (costs["weight_bytes"] + kv_bytes)
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
        "kv_bytes": kv_bytes,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "context": context,
        "torch_threads": torch.get_num_threads(),
    }
