"""The hf backend's sampler before and after issue 34, on this CPU (one torch thread, as a run's workers have).

Two measurements, interleaved and repeated (medians, min and max):

1. ``sampler``: one sampling step alone on SmolLM2-shaped logits (vocabulary 49,152) at batch 16 / 64 / 256:
   the old per-request ``torch.Generator`` draw (the code as it was, copied below) against ``SeededSampler``.
2. ``decode``: the hf backend's tokens/s on SmolLM2-135M at batch 16 and 64 (32 new tokens, prompts of 32), run
   from two checkouts: ``--before`` (a worktree of the commit before the sampler) and this one.

    git worktree add /tmp/before afa45be~1
    OMP_NUM_THREADS=1 .venv/bin/python docs/results/sampler_ab.py --before /tmp/before \
        --out docs/results/sampler_ab.json
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

from flexmarl.rollout.sampling import SeededSampler

VOCAB = 49152
DECODE = ("from flexmarl.bench.backend_bench import backend_throughput; import json, torch; "
          "torch.set_num_threads(1); print(json.dumps(backend_throughput('hf', 'smollm2-135m-instruct', {batch}, 32, "
          "prompt_len=32, repeats=2)))")


def old_sampler(logits: torch.Tensor, generators: list[torch.Generator], temperature: float = 1.0) -> torch.Tensor:
    """The sampling step of hf_backend.py before issue 34 (its logits were copied to the host first)."""
    logits = logits.float().cpu()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    uniform = torch.stack([torch.rand(logp.shape[-1], generator=g) for g in generators])
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20)))
    tokens = torch.argmax(logp + gumbel, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def sampler_rounds(batches: list[int], repeats: int) -> dict:
    out = {}
    for batch in batches:
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
        generators = [torch.Generator().manual_seed(i) for i in range(batch)]
        new = SeededSampler(range(batch), vocab=VOCAB, device=torch.device("cpu"))
        times: dict[str, list[float]] = {"before": [], "after": []}
        old_sampler(logits, generators), new(logits, step=0, temperature=1.0)  # warm-up
        for step in range(repeats):  # interleaved
            start = time.perf_counter()
            old_sampler(logits, generators)
            times["before"].append(time.perf_counter() - start)
            start = time.perf_counter()
            new(logits, step=step, temperature=1.0)
            times["after"].append(time.perf_counter() - start)
        out[str(batch)] = {k: spread(v) for k, v in times.items()}
        out[str(batch)]["ratio"] = out[str(batch)]["before"]["median"] / out[str(batch)]["after"]["median"]
        print(f"sampler batch {batch}: {out[str(batch)]}", flush=True)
    return out


def decode_rounds(before: Path, batches: list[int], rounds: int) -> dict:
    trees = {"before": before, "after": Path(__file__).resolve().parents[2]}
    runs: dict[str, dict[str, list[dict]]] = {str(b): {k: [] for k in trees} for b in batches}
    for _ in range(rounds):
        for batch in batches:
            for name, tree in trees.items():  # interleaved
                done = subprocess.run([sys.executable, "-c", DECODE.format(batch=batch)], cwd=tree, check=True,
                                      capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                runs[str(batch)][name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"decode batch {batch} {name}: {runs[str(batch)][name][-1]['tokens_per_s']:.1f} tokens/s",
                      flush=True)
    out = {}
    for batch, by_tree in runs.items():
        out[batch] = {name: spread([r["tokens_per_s"] for r in rs]) for name, rs in by_tree.items()}
        out[batch]["ratio"] = out[batch]["after"]["median"] / out[batch]["before"]["median"]
        out[batch]["after_sampler_share_reported"] = spread([r["sampler_share"] for r in by_tree["after"]])
    return out


def shares(report: dict) -> dict:
    """The sampler's share of a decode step, before and after: its median time (part 1) over the step's time at
    that batch (``batch`` over the median tokens/s of part 2)."""
    out = {}
    for batch, decode in report["decode"].items():
        sampler = report["sampler"][batch]
        out[batch] = {k: sampler[k]["median"] / (int(batch) / decode[k]["median"]) for k in ("before", "after")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before the sampler")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"vocab": VOCAB, "torch_threads": 1,
              "sampler": sampler_rounds([16, 64, 256], args.repeats),
              "decode": decode_rounds(args.before, [16, 64], args.rounds)}
    report["sampler_share_of_step"] = shares(report)
    print(report["sampler_share_of_step"])
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
