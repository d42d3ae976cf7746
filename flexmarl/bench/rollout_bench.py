"""`flexmarl bench rollout`: what dependency-parallel sampling and inter-agent balancing buy, in one run.

On a skewed fan-out workload (a planner feeds three solver calls with the longest answers, an aggregator
reads them), the rollout engine samples one global batch of episodes, without training, four ways on one
cluster: layered (each layer of the graph waits for the whole previous one, as in synchronous frameworks)
against dependency-parallel (a node starts once its parents are done), and dependency-parallel with and
without the inter-agent balancer. Each way runs ``repeats`` times and reports its median wall time, since the
machine is shared. Every way samples the same episodes: requests are seeded per sample. It also measures
each rollout backend's tokens/s on ``backend_model`` (vLLM through ``.venv-vllm`` when that exists).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from flexmarl.bench.backend_bench import compare_backends
from flexmarl.cluster.local import open_cluster
from flexmarl.config import load_config
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.orchestrator.runtime import RunContext, Runtime
from flexmarl.run.prepare import prepare_run
from flexmarl.report.timeline import draw_queues, draw_timeline

# The fan_out preset, skewed harder: the solver's three calls carry nearly all the tokens, and the aggregator
# runs the small model, so that the replicas dealt evenly at the start are far from where the work is.
SKEW = ["agents.aggregator.model=tiny", "agents.solver.sampling.max_new_tokens=96", "run.queries_per_step=16"]
# Each way of sampling is a set of overrides of the same workload (one step, no training).
WAYS: dict[str, list[str]] = {
    "layered": ["run.mode=sync", "rollout.load_balance=true"],
    "dependency": ["run.mode=flexmarl", "rollout.load_balance=true"],
    "without_lb": ["run.mode=flexmarl", "rollout.load_balance=false"],
}


def sample_once(overrides: list[str], run_dir: Path, address: str, workload: str) -> PipelineResult:
    cfg = load_config(preset=workload, overrides=[*SKEW, *overrides, "run.steps=1"])
    run_id, store_uri = prepare_run(cfg, run_dir)
    runtime = Runtime(RunContext(run_id, str(run_dir.resolve()), store_uri, address), cfg)
    try:
        runtime.start_engines()
        return runtime.run(train=False)
    finally:
        runtime.close()


def bench_rollout(
    *,
    out_dir: Path,
    workload: str = "fan_out",
    repeats: int = 3,
    backend_model: str = "tiny-large",
    log: Callable[[str], None] = print,
) -> dict:
    """Write ``out_dir/bench_rollout.json`` and timeline/queue pictures of the last repeat of each way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(preset=workload, overrides=SKEW)
    walls: dict[str, list[float]] = {w: [] for w in WAYS}
    last: dict[str, PipelineResult] = {}
    with open_cluster(cfg.cluster) as address:
        for r in range(repeats):
            for way, overrides in WAYS.items():  # interleaved, so that a noisy minute hits every way alike
                t0 = time.perf_counter()
                last[way] = sample_once(overrides, out_dir / "runs" / f"{way}-{r}", address, workload)
                walls[way].append(last[way].wall_s)
                log(f"{way} #{r}: {last[way].wall_s:.2f} s rollout ({time.perf_counter() - t0:.1f} s with set-up), "
                    f"{len(last[way].moves)} slot moves")
    median = {w: statistics.median(v) for w, v in walls.items()}
    tokens = last["dependency"].tokens
    backends = compare_backends(backend_model)
    report = {
        "workload": workload,
        "episodes": cfg.run.queries_per_step * cfg.run.group_size,
        "tokens": tokens,
        "repeats": repeats,
        "backends": backends["backends"],
        "decode_limit": backends["limit"],
        "dependency_parallel": {
            "layered_s": median["layered"], "dependency_s": median["dependency"],
            "speedup": median["layered"] / median["dependency"],
        },
        "balancing": {
            "with_lb": {"wall_s": median["dependency"], "capacity_moves": len(last["dependency"].moves),
                        "tokens_per_s": tokens / median["dependency"]},
            "without_lb": {"wall_s": median["without_lb"], "capacity_moves": len(last["without_lb"].moves),
                           "tokens_per_s": tokens / median["without_lb"]},
            "speedup": median["without_lb"] / median["dependency"],
            "threshold": cfg.rollout.balance_threshold,
            "moves": [{"at": round(m.at, 3), "from": m.source, "to": m.target,
                       "loads": [round(m.source_load, 2), round(m.target_load, 2)]} for m in last["dependency"].moves],
        },
        "wall_s_all": walls,
    }
    for way, result in last.items():
        draw_timeline(result, out_dir / f"timeline_{way}.png", title=f"rollout, {way}")
        draw_queues(result, out_dir / f"queues_{way}.png", title=way)
    (out_dir / "bench_rollout.json").write_text(json.dumps(report, indent=2))
    return report
