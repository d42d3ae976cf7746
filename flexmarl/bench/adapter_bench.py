"""What LoRA adapter agents save against full-model agents: bytes per weight sync and per state swap, and the
peak memory of a worker that holds every agent's replica and trainer (``flexmarl bench adapters``).

For each agent count, a fresh process (so that its peak resident memory is its own) builds, as one worker of a
load-balanced run does, a rollout replica and a trainer of every agent, samples a batch and trains one update
per agent, then reports its peak RSS, the bytes a weight sync carries (``AgentTrainer.weights``) and the bytes a
state swap moves (``HostCopy.nbytes``: weights and Adam moments). Full-model agents each load their own model
twice (replica and trainer); adapter agents share one base for the replicas and one for the trainers.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence

from flexmarl.bench.memory import peak_rss_bytes
from flexmarl.models.adapter_config import AdapterConfig

KINDS = ("full", "lora")


def _one_worker(model: str, agents: int, kind: str, adapter: dict) -> dict:
    import torch

    from flexmarl.models.adapters import AdapterHost
    from flexmarl.models.loading import resolve_model
    from flexmarl.rollout.adapter_backend import AdapterBackend
    from flexmarl.rollout.backend import GenerationRequest, WeightUpdate
    from flexmarl.rollout.hf_backend import HFBackend
    from flexmarl.training.config import TrainerConfig
    from flexmarl.training.state import HostCopy, tensor_bytes
    from flexmarl.training.trainer import AgentTrainer, TrainBatch

    torch.set_num_threads(1)
    model_dir = resolve_model(model)
    lora = AdapterConfig(**adapter) if kind == "lora" else None
    config = TrainerConfig(lr=1e-5, adapter=lora)
    device = HFBackend.default_device()
    rollout_host = AdapterHost(model_dir, device) if lora else None
    train_host = AdapterHost(model_dir, device) if lora else None
    sync, swap = [], []
    engines = []  # kept alive to the end: the peak is that of a worker holding all of them
    for i in range(agents):
        name = f"agent_{i}"
        replica = AdapterBackend(rollout_host, name, lora) if lora else HFBackend(model_dir)
        trainer = AgentTrainer(name, model_dir, config, temperature=1.0, max_new_tokens=8, host=train_host)
        requests = [GenerationRequest(f"{name}-{j}", [1, 2, 3, 4, 5, 6, 7, 8], 8, 1.0, seed=j) for j in range(4)]
        results = replica.generate(requests)
        trainer.train_step(TrainBatch([r.request_id for r in results], [q.prompt_ids for q in requests],
                                      [r.response_ids for r in results], [r.logprobs for r in results],
                                      [1.0, -1.0, 0.5, -0.5], [0] * 4))
        weights = trainer.weights()
        replica.update_weights(WeightUpdate(name, trainer.version, weights))
        sync.append(tensor_bytes(weights))
        swap.append(HostCopy.capture(trainer).nbytes)
        engines.append((replica, trainer))
    return {"kind": kind, "agents": agents, "peak_rss_bytes": peak_rss_bytes(), "sync_bytes_per_update": max(sync),
            "swap_bytes": max(swap)}


def _in_fresh_process(*args) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_one_worker, args)


def bench_adapters(model: str, agent_counts: Sequence[int] = (2, 4), adapter: AdapterConfig | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """One fresh worker process per (kind, agent count); returns each figure and the adapter/full ratios."""
    adapter = adapter or AdapterConfig()
    runs = []
    for agents in agent_counts:
        for kind in KINDS:
            log(f"adapter benchmark: {agents} {kind} agents of {model}")
            runs.append(_in_fresh_process(model, agents, kind, adapter.model_dump()))
    by = {(r["kind"], r["agents"]): r for r in runs}
    ratios = {
        f"{agents}_agents": {key: by["lora", agents][key] / by["full", agents][key]
                             for key in ("peak_rss_bytes", "sync_bytes_per_update", "swap_bytes")}
        for agents in agent_counts
    }
    return {"model": model, "adapter": adapter.model_dump(), "runs": runs, "lora_over_full": ratios}
