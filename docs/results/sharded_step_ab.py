# One-off A/B behind sharded_step_ab.json: one SmolLM2-135M optimizer step (a global batch of 32 samples of a
# 60-token prompt and a 24-token answer, in micro-batches of 16) by one trainer on one worker process against the
# same step sharded over two worker processes (training.sharding: full, FSDP2 over gloo). Each its own
# LocalCluster, both alive; interleaved, median [min, max] s, and each rank's peak memory over what its process
# held before it built the trainer.
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


def main(repeats: int) -> None:
    model = str(resolve_model("smollm2-135m-instruct"))
    plain, sharded = TrainerConfig(lr=1e-6, micro_batch_size=MICRO), TrainerConfig(lr=1e-6, micro_batch_size=MICRO,
                                                                                   sharding="full")
    data, times, peaks = batch(), {"one worker": [], "sharded over two": []}, {}
    cluster = dict(threads_per_worker=1, processes=True, dashboard_address=":0", env=worker_env())
    with LocalCluster(n_workers=1, **cluster) as one, Client(one) as c1, \
            LocalCluster(n_workers=2, **cluster) as two, Client(two) as c2:
        register(c1), register(c2)
        w1 = tuple(c1.scheduler_info(n_workers=-1)["workers"])
        w2 = tuple(sorted(c2.scheduler_info(n_workers=-1)["workers"]))
        rendezvous = Rendezvous(two.scheduler_address)  # served for as long as it is referenced
        group = TrainerGroup("ab.1", w2, rendezvous.address, 600.0)
        base = {"one worker": [submit_on(c1, w1[0], start, KEY, model, plain, 1.0, ANSWER, 0).result()],
                "sharded over two": c2.gather([submit_on(c2, w, start, KEY, model, sharded, 1.0, ANSWER, 0, group)
                                               for w in w2])}
        for r in range(repeats + 1):  # the first round warms up and is not counted
            s1, p1 = submit_on(c1, w1[0], step, KEY, data, False).result()
            ranks = c2.gather([submit_on(c2, w, step, KEY, data, True) for w in w2])
            if r:
                times["one worker"].append(s1)
                times["sharded over two"].append(max(s for s, _ in ranks))
            peaks = {"one worker": [p1], "sharded over two": [p for _, p in ranks]}
    tokens = SAMPLES * (PROMPT + ANSWER)
    report = {"command": f".venv/bin/python docs/results/sharded_step_ab.py {repeats}", "model": model,
              "samples": SAMPLES, "micro_batch": MICRO, "prompt_tokens": PROMPT, "answer_tokens": ANSWER,
              "modes": {m: {"step_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "rounds": t,
                            "tokens_per_s": tokens / statistics.median(t),
                            "peak_rss_over_start_bytes_per_rank": [p - b for p, b in zip(peaks[m], base[m])]}
                        for m, t in times.items()}}
    report["speedup"] = report["modes"]["one worker"]["step_s"] / report["modes"]["sharded over two"]["step_s"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
