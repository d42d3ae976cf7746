"""The all-reduce of a trainer group's optimizer step on this machine: SmolLM2-135M's float64 gradient sums (and
the loss counters) between two Dask workers, through ``flexmarl.training.group`` as a step runs it.

Run: ``.venv/bin/python docs/results/group_reduce_ab.py`` (about a minute; nothing else running). Writes
``docs/results/group_reduce.json``: per repeat, each rank's seconds; the transfer is the last rank's (it waits
for no other).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from distributed import Client

from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster, submit_on
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.models.loading import load_model, resolve_model
from flexmarl.training.group import Rendezvous, TrainerGroup, all_reduce, process_group

KEY = EngineKey("reduce-ab", "solver")
REPEATS = 5


def shapes() -> list[tuple[int, ...]]:
    model = load_model(resolve_model("smollm2-135m-instruct"))
    return [tuple(p.shape) for p in model.parameters()]


def reduce_once(group: TrainerGroup, sizes: list[tuple[int, ...]]) -> tuple[float, float]:
    sums = [torch.ones(s, dtype=torch.float64) for s in sizes]
    counters = torch.zeros(9, dtype=torch.float64)
    pg = process_group(KEY, group)
    start = time.perf_counter()
    all_reduce(pg, [*sums, counters])
    took = time.perf_counter() - start
    assert float(sums[0].flatten()[0]) == group.size  # summed over the ranks
    return took, time.time()


def main() -> None:
    sizes = shapes()
    grad_bytes = sum(torch.Size(s).numel() for s in sizes) * 8
    rendezvous = Rendezvous("tcp://127.0.0.1:1")
    runs = []
    with open_cluster(ClusterConfig(n_workers=2)) as address, Client(address) as client:
        register(client)
        members = tuple(sorted(client.scheduler_info(n_workers=-1)["workers"]))
        for r in range(REPEATS):
            group = TrainerGroup(f"reduce-ab/{r}", members, rendezvous.address, 120.0)
            ranks = client.gather([submit_on(client, w, reduce_once, group, sizes) for w in members])
            runs.append([t for t, _ in ranks])
    transfer = [min(r) for r in runs]
    report = {"model": "smollm2-135m-instruct", "ranks": 2, "float64_gradient_bytes": grad_bytes,
              "repeats": runs, "transfer_s_median": statistics.median(transfer),
              "transfer_s_min": min(transfer), "transfer_s_max": max(transfer),
              "gb_per_s_median": grad_bytes / statistics.median(transfer) / 1e9}
    out = Path(__file__).with_name("group_reduce.json")
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "repeats"}, indent=2))


if __name__ == "__main__":
    main()
