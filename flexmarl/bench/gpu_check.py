"""The GPU figures in one run: ``python -m flexmarl.bench.gpu_check OUT_DIR [--smoke]`` writes
OUT_DIR/gpu_check_<gpu>_<date>.json (``report_name``), e.g. ``gpu_check_h100_2026-12-06.json``.

Written for a machine lent for minutes (``scripts/gpu_check.sh`` runs it there), so it downloads nothing and
writes its JSON after every section: a section that fails records its error and the next one still runs.

- ``rollout``: the hf backend's tokens/s at batch 16 / 64 / 256 (GRPO groups of 4) for a SmolLM2-135M and a
  Qwen2-0.5B shaped model, with its sampler's share of a decode step, beside plain ``model.generate`` at the same
  batch and the roofline of a decode step on this GPU (``decode_limit``: weight and KV bytes at the measured
  bandwidth, FLOPs at the measured matmul rate); vLLM's too where this Python has it (its GPU build does not
  travel to a lent machine).
- ``decode``: the hf backend's tokens/s for SmolLM2 at each batch with each ``rollout.decode`` (dynamic cache,
  static cache, compiled step with CUDA graphs; the compiled one's first batch compiles, a warm-up not timed):
  the measurement that picks the GPU's default.
- ``training``: one micro-batch's forward and backward (bf16 autocast on a GPU), tokens/s and model FLOPs
  utilisation: 3x the forward's 2 FLOPs per linear weight per token (the vocabulary projection on response
  tokens only, as the trainer computes it; attention left out), over the bf16 matmul rate measured here.
- ``swap``: ``bench swap``'s legs for both (pinned against pageable host copies, bit-exact check).
- ``weight_sync``: one update's weight sync in the pipeline's two legs: the trainer's copy to the host
  (``AgentTrainer.weights``) and the replica's load (``HFBackend.update_weights``).
- ``pipeline``: ``bench pipeline`` on the fan-out with SmolLM2-shaped agents, sync against flexmarl, bf16 training.

The models are built from their configs with seeded random weights (no weights can travel to such a machine):
speed depends on the shapes, not the values. Both use the SmolLM2 tokenizer found in ``--tokenizer-dir``.
``--smoke`` shrinks every shape and count so that the whole script runs on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flexmarl.bench.timing import timed
from flexmarl.models.loading import resolve_model

SMOLLM2_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What ``--tokenizer-dir`` must hold: SmolLM2's config (the 135M shape) and its tokenizer."""
QWEN2_05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
             "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
"""Qwen2-0.5B's shape (its config.json)."""
SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2}
BATCHES, SMOKE_BATCHES = (16, 64, 256), (4, 8)
NEW_TOKENS, PROMPT_LEN = 64, 64
SECTIONS = ("rollout", "decode", "training", "swap", "weight_sync", "pipeline")
DECODES = ("dynamic", "static", "compiled")
TRAIN_BATCH, SMOKE_TRAIN_BATCH = 16, 4


def build_models(out: Path, tokenizer_dir: Path, smoke: bool, names: set[str]) -> dict[str, Path]:
    """The model directories of ``names`` (config, seeded random weights, the SmolLM2 tokenizer), built once."""
    shapes = {"smollm2-135m": json.loads((tokenizer_dir / "config.json").read_text()), "qwen2-0.5b": dict(QWEN2_05B)}
    shapes = {name: shape for name, shape in shapes.items() if name in names}
    dirs = {}
    for name, shape in shapes.items():
        if smoke:
            shape.update(SMOKE, head_dim=SMOKE["hidden_size"] // SMOKE["num_attention_heads"])
        model_dir = out / "models" / name
        if not (model_dir / "model.safetensors").exists():
            model_dir.mkdir(parents=True, exist_ok=True)
            for f in SMOLLM2_FILES[1:]:
                if (tokenizer_dir / f).exists():
                    shutil.copy(tokenizer_dir / f, model_dir / f)
            model_type = shape.pop("model_type")
            shape = {k: v for k, v in shape.items() if not k.startswith(("_", "transformers_version", "architectures"))}
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).save_pretrained(model_dir)
        dirs[name] = model_dir
    return dirs


def rollout(models: dict[str, Path], smoke: bool) -> dict:
    from flexmarl.bench.backend_bench import backend_throughput, generate_throughput
    from flexmarl.bench.decode_limit import decode_limit
    from flexmarl.rollout.config import vllm_installed

    backends = ("hf", "vllm") if vllm_installed() else ("hf",)
    new_tokens = 8 if smoke else NEW_TOKENS
    out: dict = {"backends": list(backends)}
    for name, d in models.items():
        out[name] = {}
        for b in SMOKE_BATCHES if smoke else BATCHES:
            row = {backend: backend_throughput(backend, str(d), b, new_tokens, prompt_len=PROMPT_LEN, repeats=2,
                                               group=4) for backend in backends}
            row["generate"] = generate_throughput(str(d), b, new_tokens, prompt_len=PROMPT_LEN)
            row["limit"] = decode_limit(d, batch=b, context=PROMPT_LEN + new_tokens // 2, seconds=0.1 if smoke else 0.5)
            for result in (row[backend] for backend in (*backends, "generate")):
                result["share_of_limit"] = result["tokens_per_s"] / row["limit"]["tokens_per_s"]
            out[name][str(b)] = row
            _log(f"rollout {name} batch {b}: hf {row['hf']['tokens_per_s']:.0f} tokens/s, generate "
                 f"{row['generate']['tokens_per_s']:.0f}, roofline {row['limit']['tokens_per_s']:.0f}")
    return out


def decode(models: dict[str, Path], smoke: bool) -> dict:
    from flexmarl.bench.backend_bench import backend_throughput

    new_tokens = 8 if smoke else NEW_TOKENS
    out: dict = {}
    for b in SMOKE_BATCHES if smoke else BATCHES:
        out[str(b)] = {}
        for mode in DECODES:
            try:
                out[str(b)][mode] = backend_throughput("hf", str(models["smollm2-135m"]), b, new_tokens,
                                                       prompt_len=PROMPT_LEN, repeats=2, group=4, decode=mode)
            except Exception as exc:  # noqa: BLE001 - recorded: a compile that fails leaves the other modes' figures
                out[str(b)][mode] = {"error": f"{type(exc).__name__}: {exc}"}
        _log(f"decode batch {b}: " + ", ".join(f"{m} {r.get('tokens_per_s', 0):.0f}" for m, r in out[str(b)].items()))
    return out


def training(models: dict[str, Path], smoke: bool, repeats: int = 3) -> dict:
    from flexmarl.bench.decode_limit import matmul_flops_per_s, model_costs
    from flexmarl.training.config import TrainerConfig
    from flexmarl.training.trainer import AgentTrainer, TrainBatch

    from flexmarl.rollout.hf_backend import HFBackend

    device = HFBackend.default_device()
    cuda = device.type == "cuda"
    n, new_tokens = (SMOKE_TRAIN_BATCH, 8) if smoke else (TRAIN_BATCH, NEW_TOKENS)
    peak = matmul_flops_per_s(device, torch.bfloat16 if cuda else torch.float32, seconds=0.2 if smoke else 1.0)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"peak_matmul_tflops": peak / 1e12, "micro_batch": n, "prompt_len": PROMPT_LEN,
                 "new_tokens": new_tokens, "mixed_precision": "bf16" if cuda else "no"}
    for name, d in models.items():
        config = TrainerConfig(mixed_precision=out["mixed_precision"], micro_batch_size=n)
        trainer = AgentTrainer(name, d, config, temperature=1.0, max_new_tokens=new_tokens)
        vocab = trainer.model.config.vocab_size
        batch = TrainBatch(
            sample_ids=[f"s{i}" for i in range(n)],
            prompt_ids=[torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)],
            response_ids=[torch.randint(3, vocab, (new_tokens,), generator=gen, dtype=torch.int32) for _ in range(n)],
            logprobs=[torch.full((new_tokens,), -5.0) for _ in range(n)],
            advantages=[float(i % 3 - 1) for i in range(n)],
            versions=[0] * n,
        )
        trainer.begin_step()
        trainer.accumulate(batch)  # warm-up
        step_s = statistics.median(timed(lambda b=batch, t=trainer: t.accumulate(b)) for _ in range(repeats))
        cfg = trainer.model.config
        head = 2 * cfg.vocab_size * cfg.hidden_size
        tokens = n * (PROMPT_LEN + new_tokens)
        # forward and a backward of twice its FLOPs; the vocabulary projection only where a response token is
        flops = 3 * ((model_costs(d)["linear_flops_per_token"] - head) * tokens + head * n * new_tokens)
        out[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "flops": flops,
                     "mfu": flops / step_s / peak}
        _log(f"training {name}: {tokens / step_s:.0f} tokens/s, MFU {out[name]['mfu']:.1%}")
        trainer.close()
    return out


def swap(models: dict[str, Path], smoke: bool) -> dict:
    from flexmarl.bench.swap_bench import bench_one
    from flexmarl.models.adapter_config import AdapterConfig

    out = {name: bench_one(str(d)) for name, d in models.items()}
    out["smollm2-135m-lora-r8"] = bench_one(str(models["smollm2-135m"]), adapter=AdapterConfig(r=8, alpha=16))
    return out


def weight_sync(models: dict[str, Path], smoke: bool, repeats: int = 5) -> dict:
    from flexmarl.rollout.backend import WeightUpdate
    from flexmarl.rollout.hf_backend import HFBackend
    from flexmarl.training.config import TrainerConfig
    from flexmarl.training.state import tensor_bytes
    from flexmarl.training.trainer import AgentTrainer

    out = {}
    for name, d in models.items():
        trainer = AgentTrainer(name, d, TrainerConfig(lr=1e-5), temperature=1.0)
        replica = HFBackend(d)
        to_host, load, in_place = [], [], []
        weights: dict[str, torch.Tensor] = {}
        for version in range(1, repeats + 1):  # through the host (a replica on another worker), and in place
            to_host.append(timed(lambda: weights.update(trainer.weights())))
            load.append(timed(lambda v=version: replica.update_weights(WeightUpdate(name, 2 * v - 1, weights))))
            in_place.append(timed(lambda v=version: replica.update_weights(
                WeightUpdate(name, 2 * v, trainer.weights_in_place()))))
        out[name] = {"bytes": tensor_bytes(weights), "to_host_s": statistics.median(to_host),
                     "load_s": statistics.median(load), "in_place_s": statistics.median(in_place),
                     "repeats": repeats}
        trainer.close()
    return out


def pipeline(models: dict[str, Path], smoke: bool, work_dir: Path, out_dir: Path, repeats: int) -> dict:
    from flexmarl.bench.pipeline_bench import WORKLOADS, bench_pipeline

    _, extra = WORKLOADS["fan_out_smollm2"]
    overrides = [*(o for o in extra if ".model=" not in o),
                 *(f"agents.{a}.model={models['smollm2-135m']}" for a in ("planner", "solver", "aggregator")),
                 # a built-in task: reasoning-gym (and its dependencies) need not travel to the machine
                 "data.dataset=copy_digits", "data.dataset_args={}", "training.mixed_precision=bf16"]
    report = bench_pipeline(out_dir=work_dir / "pipeline", modes=("sync", "flexmarl"), steps=1 if smoke else 2,
                            workload="fan_out", overrides=overrides, repeats=repeats, log=_log)
    for mode in report["modes"]:  # the pictures beside the JSON; the run directories stay in work_dir
        shutil.copy(work_dir / "pipeline" / f"timeline_{mode}.png", out_dir / f"timeline_{mode}.png")
    return report


def report_name(device: str, day: str | None = None) -> str:
    """``gpu_check_<gpu>_<date>.json``: the GPU's model number from its name ("NVIDIA H100 80GB HBM3" -> h100),
    or ``cpu``, and today's date, as docs/results keeps them."""
    gpu = next((w.lower() for w in device.split() if any(c.isdigit() for c in w)), device.split()[-1].lower())
    return f"gpu_check_{gpu}_{day or time.strftime('%Y-%m-%d')}.json"


def _log(line: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run(out_dir: Path, tokenizer_dir: Path, *, work_dir: Path | None = None, smoke: bool = False,
        sections: tuple[str, ...] = SECTIONS, pipeline_repeats: int = 2) -> dict:
    """Every section in turn; the JSON (``report_name``) is rewritten after each one. Models and run directories
    go to ``work_dir`` (``out_dir/work`` by default): out_dir keeps only the JSON and the timelines."""
    work_dir = work_dir or out_dir / "work"
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "smoke": smoke}
    # the pipeline runs SmolLM2-shaped agents only
    names = {"smollm2-135m"} | ({"qwen2-0.5b"} if set(sections) - {"pipeline"} else set())
    models = build_models(work_dir, tokenizer_dir, smoke, names)
    steps = {"rollout": rollout, "decode": decode, "training": training, "swap": swap, "weight_sync": weight_sync,
             "pipeline": lambda m, s: pipeline(m, s, work_dir, out_dir, pipeline_repeats)}
    for section in sections:
        _log(f"{section}: starting")
        start = time.perf_counter()
        try:
            report[section] = steps[section](models, smoke)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next section still runs
            report[section] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            _log(f"{section}: FAILED {type(exc).__name__}: {exc}")
        report.setdefault("seconds", {})[section] = time.perf_counter() - start
        (out_dir / report_name(report["device"])).write_text(json.dumps(report, indent=2, default=str))
        _log(f"{section}: {report['seconds'][section]:.1f} s")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help=f"a directory with SmolLM2's {', '.join(SMOLLM2_FILES)} (default: the local SmolLM2)")
    parser.add_argument("--work-dir", type=Path, default=None, help="models and run directories (default OUT_DIR/work)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts: a CPU check of the script")
    parser.add_argument("--pipeline-repeats", type=int, default=2, help="interleaved rounds of sync and flexmarl")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    tokenizer_dir = args.tokenizer_dir or resolve_model("smollm2-135m-instruct")
    missing = [f for f in SMOLLM2_FILES[:2] if not (tokenizer_dir / f).exists()]
    if missing:
        parser.error(f"{tokenizer_dir} lacks {', '.join(missing)}: pass --tokenizer-dir with SmolLM2's files")
    run(args.out_dir, tokenizer_dir, work_dir=args.work_dir, smoke=args.smoke, sections=sections,
        pipeline_repeats=args.pipeline_repeats)


if __name__ == "__main__":
    main()
