"""The hf backend's decode step three ways on this CPU (``rollout.decode``): transformers' dynamic KV cache, a
static cache, and the static cache with the step compiled by torch.compile. SmolLM2-135M, one torch thread,
GRPO groups of 4, 32 prompt and 32 new tokens; rounds interleave the modes; medians, min and max. The compiled
step's compilation falls in each measurement's untimed warm-up batch.

    OMP_NUM_THREADS=1 .venv/bin/python docs/results/decode_modes_ab.py --out docs/results/decode_modes_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from flexmarl.bench.backend_bench import backend_throughput

MODES = ("dynamic", "static", "compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, dict[str, list[float]]] = {str(b): {m: [] for m in MODES} for b in (16, 64)}
    for _ in range(args.rounds):
        for batch, by_mode in runs.items():
            for mode in MODES:
                result = backend_throughput("hf", "smollm2-135m-instruct", int(batch), 32, prompt_len=32, repeats=2,
                                            group=4, decode=mode)
                by_mode[mode].append(result["tokens_per_s"])
                print(f"batch {batch} {mode}: {result['tokens_per_s']:.1f} tokens/s", flush=True)
    report = {batch: {mode: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
                      for mode, xs in by_mode.items()} for batch, by_mode in runs.items()}
    args.out.write_text(json.dumps({"model": "smollm2-135m-instruct", "torch_threads": 1, "new_tokens": 32,
                                    "prompt_len": 32, "group": 4, "tokens_per_s": report}, indent=2))


if __name__ == "__main__":
    main()
