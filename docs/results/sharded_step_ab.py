# One-off A/B behind sharded_step_ab.json: one SmolLM2-135M optimizer step (a global batch of 32 samples of a
# 60-token prompt and a 24-token answer, in micro-batches of 16) by one trainer on one worker process against the
# same step over two worker processes, sharded by FSDP2 (training.sharding: full) and by ZeRO-1 (optimizer), over
# gloo. Each its own LocalCluster, all alive; interleaved, median [min, max] s, and each rank's peak memory over
# what its process held before it built the trainer.
# Run: .venv/bin/python docs/results/sharded_step_ab.py 3
import json
import statistics
import sys
import time

import torch
from distributed import Client, LocalCluster

from flexmarl.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from flexmarl.cluster.local import submit_on, worker_env
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.models.loading import resolve_model
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import Rendezvous, TrainerGroup
from flexmarl.training.trainer import TrainBatch

KEY = EngineKey("ab", "solver")
SAMPLES, MICRO, PROMPT, ANSWER = 32, 16, 60, 24


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (SAMPLES, PROMPT + ANSWER), generator=g).tolist()
    return TrainBatch([f"s{i:02d}" for i in range(SAMPLES)], [i[:PROMPT] for i in ids], [i[PROMPT:] for i in ids],
                      [[-2.0] * ANSWER] * SAMPLES, [(-1.0) ** i for i in range(SAMPLES)], [0] * SAMPLES)


def step(key: EngineKey, data: TrainBatch, sharded: bool) -> tuple[float, int]:
    from flexmarl.training.group import world_all_reduce

    held = slot.trainer(key)
    start = time.perf_counter()
    for i in range(0, len(data), MICRO):
        held.accumulate(data.slice(i, i + MICRO))
    held.finish_step(reduce=world_all_reduce if sharded else None)
    return time.perf_counter() - start, peak_rss_bytes()


def start(key: EngineKey, *args) -> int:
    before = rss_bytes()
    reset_peak_rss()
    slot.start_trainer(key, *args)
    return before


ONE, FULL, ZERO = "one worker", "sharded over two", "ZeRO-1 over two"


def main(repeats: int) -> None:
    model = str(resolve_model("smollm2-135m-instruct"))
    configs = {ONE: TrainerConfig(lr=1e-6, micro_batch_size=MICRO),
               FULL: TrainerConfig(lr=1e-6, micro_batch_size=MICRO, sharding="full"),
               ZERO: TrainerConfig(lr=1e-6, micro_batch_size=MICRO, sharding="optimizer")}
    data, times, peaks, base = batch(), {m: [] for m in configs}, {}, {}
    options = dict(threads_per_worker=1, processes=True, dashboard_address=":0", env=worker_env())
    with LocalCluster(n_workers=1, **options) as one, Client(one) as c1, \
            LocalCluster(n_workers=2, **options) as full, Client(full) as c2, \
            LocalCluster(n_workers=2, **options) as zero, Client(zero) as c3:
        clients = {ONE: c1, FULL: c2, ZERO: c3}
        rendezvous = {m: Rendezvous(c.scheduler.address) for m, c in clients.items()}  # served while referenced
        workers, groups = {}, {}
        for m, c in clients.items():
            register(c)
            workers[m] = tuple(sorted(c.scheduler_info(n_workers=-1)["workers"]))
            groups[m] = TrainerGroup(f"ab.{m}", workers[m], rendezvous[m].address, 600.0) if m != ONE else None
            base[m] = c.gather([submit_on(c, w, start, KEY, model, configs[m], 1.0, ANSWER, 0, groups[m])
                                for w in workers[m]])
        for r in range(repeats + 1):  # the first round warms up and is not counted
            for m, c in clients.items():
                ranks = c.gather([submit_on(c, w, step, KEY, data, m != ONE) for w in workers[m]])
                if r:
                    times[m].append(max(s for s, _ in ranks))
                peaks[m] = [p for _, p in ranks]
    tokens = SAMPLES * (PROMPT + ANSWER)
    report = {"command": f".venv/bin/python docs/results/sharded_step_ab.py {repeats}", "model": model,
              "samples": SAMPLES, "micro_batch": MICRO, "prompt_tokens": PROMPT, "answer_tokens": ANSWER,
              "modes": {m: {"step_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "rounds": t,
                            "tokens_per_s": tokens / statistics.median(t),
                            "peak_rss_over_start_bytes_per_rank": [p - b for p, b in zip(peaks[m], base[m])]}
                        for m, t in times.items()}}
    report["speedup"] = {m: report["modes"][ONE]["step_s"] / report["modes"][m]["step_s"] for m in (FULL, ZERO)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
