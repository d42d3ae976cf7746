"""Calibration against this machine: measure the tiny models' costs, simulate `flexmarl bench pipeline`.

``measure_model`` times the real components on one CPU thread, as a Dask worker runs them: the Hugging Face
backend's prefill and decode steps at a few batch sizes, a trainer's micro-batch and optimizer step, a weight
sync, and writing and reading the training state (what a move between slots does). ``calibrated_preset``
turns these into a simulator preset of the benchmark's workload (``fan_out``: planner -> 3 solvers ->
aggregator), with its cluster (two workers that each roll out and train, one job at a time) and the
response lengths the models produce. ``calibrate_fan_out`` simulates the benchmark's modes on it and, given
a ``bench.json``, compares the predicted wall times with the measured ones.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from flexmarl.sim.costmodel import SimPreset, parse_preset
from flexmarl.sim.engine import simulate

# Costs not measured here, with their sources.
TASK_OVERHEAD_S = 0.005  # a plain Dask task costs about 3 ms here (../shared/DESIGN.md), plus the timing wrapper
COMMIT_S = 0.035  # a Delta append of one micro-batch: p50 31-35 ms at first (docs/performance.md, bench store)


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_model(model: str, *, prompt_tokens: int = 48, new_tokens: int = 32, batches: Sequence[int] = (1, 4, 16),
                  repeats: int = 3, seed: int = 0) -> dict:
    """Costs of ``model`` (a model setting, e.g. ``tiny``) on this process's device, one torch thread.

    Returns decode tokens/s by batch, prefill tokens/s, training tokens/s, the optimizer step, a weight
    sync, the state's size and its write/read bandwidth.
    """
    import torch

    from flexmarl.models.loading import resolve_model
    from flexmarl.rollout.backend import GenerationRequest, WeightUpdate
    from flexmarl.rollout.hf_backend import HFBackend
    from flexmarl.training.config import TrainerConfig
    from flexmarl.training.state import TrainingState, tensor_bytes
    from flexmarl.training.trainer import AgentTrainer, TrainBatch

    torch.set_num_threads(1)
    model_dir = resolve_model(model, seed=seed)
    backend = HFBackend(model_dir, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    vocab = backend.model.config.vocab_size

    def requests(b: int, max_new: int) -> list[GenerationRequest]:
        return [GenerationRequest(f"r{i}", torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist(),
                                  max_new, 1.0, seed + i) for i in range(b)]

    decode, prefill = {}, []
    for b in batches:
        one = requests(b, 1)
        many = requests(b, new_tokens)
        t1 = _timed(lambda one=one: backend.generate(one), repeats)
        steps = max(len(r.response_ids) for r in backend.generate(many))
        tn = _timed(lambda many=many: backend.generate(many), repeats)
        step_s = max(tn - t1, 1e-6) / max(steps - 1, 1)
        decode[b] = b / step_s
        prefill.append(b * prompt_tokens / max(t1 - step_s, 1e-6))

    trainer = AgentTrainer("calibration", model_dir, TrainerConfig(), temperature=1.0, max_new_tokens=new_tokens)
    n = 8
    batch = TrainBatch(
        sample_ids=[f"s{i}" for i in range(n)],
        prompt_ids=[torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(n)],
        response_ids=[torch.randint(3, vocab, (new_tokens,), generator=gen).tolist() for _ in range(n)],
        logprobs=[[-5.0] * new_tokens for _ in range(n)],
        advantages=[float(i % 3 - 1) for i in range(n)],
        versions=[0] * n,
    )
    trainer.begin_step()
    train_s = _timed(lambda: trainer.accumulate(batch), repeats)
    optimizer_s = _finish_after(trainer, batch, repeats)
    weights_bytes = tensor_bytes(trainer.weights())
    sync_s = _timed(lambda: backend.update_weights(WeightUpdate("calibration", 1, trainer.weights())), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        def park() -> int:  # slot.park: write the state to the state store
            return TrainingState.of(trainer).to(tmp).stored_bytes

        state_bytes = park()
        park_s = _timed(park, repeats)

        def resume() -> None:  # slot.resume: build the trainer, then read its state
            fresh = AgentTrainer("calibration", model_dir, TrainerConfig(), temperature=1.0, max_new_tokens=new_tokens)
            TrainingState.at("calibration", tmp).to("device", trainer=fresh)

        resume_s = _timed(resume, repeats)
    return {
        "model": model,
        "decode_tokens_per_s": {int(b): round(v, 1) for b, v in decode.items()},
        "prefill_tokens_per_s": round(statistics.median(prefill), 1),
        "train_tokens_per_s": round(n * (prompt_tokens + new_tokens) / train_s, 1),
        "optimizer_step_s": round(optimizer_s, 5),
        "weight_sync_s": round(sync_s, 5),
        "weights_gb": weights_bytes / 1e9,
        "state_gb": state_bytes / 1e9,
        "move_gb_per_s": state_bytes / 1e9 / ((park_s + resume_s) / 2),
        "park_s": park_s,
        "resume_s": resume_s,
    }


def _finish_after(trainer, batch, repeats: int) -> float:
    """Median seconds of the optimizer step alone (each run after one accumulated micro-batch)."""
    times = []
    for _ in range(repeats + 1):
        trainer.begin_step()
        trainer.accumulate(batch)
        start = time.perf_counter()
        trainer.finish_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_lengths(
    model: str, max_new_tokens: int, *, n: int = 64, prompt_tokens: int = 48, seed: int = 0
) -> list[int]:
    """Response lengths ``model`` samples (temperature 1) with this generation limit: the empirical distribution."""
    import torch

    from flexmarl.models.loading import resolve_model
    from flexmarl.rollout.backend import GenerationRequest
    from flexmarl.rollout.hf_backend import HFBackend

    torch.set_num_threads(1)
    backend = HFBackend(resolve_model(model, seed=seed), device="cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = backend.model.config.vocab_size
    reqs = [GenerationRequest(f"r{i}", torch.randint(3, vocab, (prompt_tokens,), generator=gen).tolist(),
                              max_new_tokens, 1.0, seed + 1000 + i) for i in range(n)]
    return sorted(len(r.response_ids) for r in backend.generate(reqs))


def prompt_tokens_of(workload: str = "fan_out") -> dict[str, int]:
    """Per agent, the tokens of its rendered prompt with empty parent fields (the simulator adds the parents'
    responses), for the first problem of the workload's data."""
    from flexmarl.config import load_config
    from flexmarl.models.loading import load_tokenizer, resolve_model
    from flexmarl.rollout.episodes import render_prompt
    from flexmarl.workloads.datasets import load_problems

    cfg = load_config(preset=workload)
    problem = load_problems(cfg.data)[0]
    graph = cfg.graph.expanded
    out: dict[str, int] = {}
    for node in graph.order():
        agent = graph.node(node).agent
        if agent in out:
            continue
        role = cfg.role(node)
        tok = load_tokenizer(resolve_model(cfg.agents[agent].model, seed=cfg.run.seed))
        fields = {**problem.fields, **graph.render_fields(node, {})}
        out[agent] = len(render_prompt(tok, role.prompt, role.system, fields))
    return out


def calibrated_preset(
    workload: str = "fan_out", *, steps: int = 3, log: Callable[[str], None] = lambda _: None
) -> dict:
    """A simulator preset (as a dict) of ``flexmarl bench pipeline --workload <workload>`` on this machine."""
    from flexmarl.config import load_config

    cfg = load_config(preset=workload)
    prompts = prompt_tokens_of(workload)
    models: dict[str, dict] = {}
    for agent, spec in cfg.agents.items():
        if spec.model in models:
            continue
        log(f"measuring {spec.model} ...")
        m = measure_model(spec.model, seed=cfg.run.seed)
        models[spec.model] = {
            "params_b": 0.001,
            "rollout_devices": 1,
            "decode_tokens_per_s": m["decode_tokens_per_s"],
            "prefill_tokens_per_s": m["prefill_tokens_per_s"],
            "train_tokens_per_s": m["train_tokens_per_s"],
            "train_overhead_s": 0.0,
            "optimizer_step_s": m["optimizer_step_s"],
            "weights_gb": max(m["weights_gb"], 1e-6),
            "state_gb": max(m["state_gb"], 1e-6),
            "weight_sync_s": m["weight_sync_s"],
            "_measured": m,
        }
        log(f"  decode {m['decode_tokens_per_s']} tokens/s by batch, train {m['train_tokens_per_s']:.0f} tokens/s, "
            f"optimizer {m['optimizer_step_s'] * 1e3:.1f} ms, sync {m['weight_sync_s'] * 1e3:.1f} ms")
    agents = {}
    for agent, spec in cfg.agents.items():
        lengths = measure_lengths(spec.model, spec.sampling.max_new_tokens, seed=cfg.run.seed)
        agents[agent] = {"model": spec.model, "prompt_tokens": prompts[agent],
                         "response": {"max": spec.sampling.max_new_tokens, "empirical": lengths}}
    move = min(m["_measured"]["move_gb_per_s"] for m in models.values())
    for m in models.values():
        del m["_measured"]
    n_workers = cfg.cluster.n_workers
    return {
        "name": f"calibrated-{workload}",
        "description": f"`flexmarl bench pipeline --workload {workload}` on this machine: {n_workers} Dask "
                       "workers of one thread, each rolling out and training one job at a time; costs measured "
                       "by flexmarl.sim.calibrate.",
        "cluster": {
            "nodes": 1, "devices_per_node": n_workers, "device_memory_gb": 8, "swap_gb_per_s": None,
            "move_gb_per_s": move,
            "layout": {"workers": n_workers, "devices_per_worker": 1, "colocated": True},
        },
        "models": models,
        "agents": agents,
        "graph": {
            "nodes": [{"name": n.name, "agent": n.agent, "copies": n.copies} for n in cfg.graph.nodes],
            "edges": [list(e) for e in cfg.graph.edges],
        },
        "workload": {
            "steps": steps, "queries_per_step": cfg.run.queries_per_step, "group_size": cfg.run.group_size,
            "micro_batch_size": cfg.training.micro_batch_size, "max_batch_size": cfg.rollout.max_batch_size,
            "replicas_per_worker": cfg.rollout.replicas_per_worker, "balance_threshold": cfg.rollout.balance_threshold,
            "balance_cooldown_s": cfg.rollout.balance_cooldown_s, "batching": "static", "seed": cfg.run.seed,
            "micro_batch_generation": cfg.rollout.micro_batch_generation,
        },
        "driver": {"task_overhead_s": TASK_OVERHEAD_S, "commit_s": COMMIT_S},
    }


def calibrate_fan_out(out_dir: Path, *, modes: Sequence[str], steps: int = 3, bench_json: Path | None = None,
                      log: Callable[[str], None] = lambda _: None) -> dict:
    """Measure, write ``calibrated-fan_out.yaml``, predict the benchmark's wall times, compare with ``bench_json``.

    Writes ``out_dir/calibration.json``: per mode the predicted wall seconds and, when measured, the measured
    ones and the relative error.
    """
    measured = json.loads(bench_json.read_text()) if bench_json else None
    if measured is not None and measured.get("steps") not in (None, steps):
        steps = measured["steps"]  # predict what was measured
    data = calibrated_preset("fan_out", steps=steps, log=log)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(data, sort_keys=False)
    (out_dir / "calibrated-fan_out.yaml").write_text(
        "# Written by `flexmarl simulate --calibrate`: costs measured on this machine (see flexmarl/sim/calibrate.py)\n"
        + text)
    preset: SimPreset = parse_preset(text, "calibrated preset")
    report: dict = {"preset": preset.name, "steps": steps, "models": data["models"], "modes": {}}
    for mode in modes:
        result = simulate(preset, mode, steps=steps)
        row: dict = {"predicted_wall_s": result.wall_s, "predicted_utilization": result.utilization()}
        if measured is not None and mode in measured.get("modes", {}):
            row["measured_wall_s"] = measured["modes"][mode]["wall_s"]
            row["measured_utilization"] = measured["modes"][mode].get("utilization")
            row["error"] = row["predicted_wall_s"] / row["measured_wall_s"] - 1
        report["modes"][mode] = row
    (out_dir / "calibration.json").write_text(json.dumps(report, indent=2))
    return report
