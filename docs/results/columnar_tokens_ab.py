# One-off A/B behind columnar_tokens_ab.json: a step's response tokens and log-probs on their way from the
# rollout backend to the trainer, as Python lists (the code before the columnar change, written out here) against
# the arrays of today's GenerationResult, list_column and TrainBatch.from_arrow. Interleaved, median [min, max] ms.
# Run: OMP_NUM_THREADS=1 .venv/bin/python docs/results/columnar_tokens_ab.py 5
import json
import pickle
import statistics
import sys
import time
from dataclasses import dataclass

import pyarrow as pa
import torch

from flexmarl.rollout.backend import GenerationResult
from flexmarl.rollout.scoring import list_column
from flexmarl.training.trainer import TrainBatch, padded

SIZES = {"this workload's step (64 samples x 12 tokens)": (64, 12),
         "a GPU-sized step (512 samples x 1,024 tokens)": (512, 1024)}
SCHEMA = pa.schema([("sample_id", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                    ("response_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())),
                    ("advantage", pa.float64()), ("policy_version", pa.int64())])


@dataclass(frozen=True)
class ListResult:  # the GenerationResult before: lists
    request_id: str
    response_ids: list
    logprobs: list


def step(tokens, logprobs, lengths, columnar: bool) -> dict[str, float]:
    t, out = time.perf_counter(), {}

    def lap(name):
        nonlocal t
        now = time.perf_counter()
        out[name] = (now - t) * 1e3
        t = now

    n = len(lengths)
    if columnar:  # backend: one view per row
        ids, lps = tokens.to(torch.int32).numpy(), logprobs.numpy()
        results = [GenerationResult(f"s{i:04d}", ids[i, : lengths[i]], lps[i, : lengths[i]], "stop", 0)
                   for i in range(n)]
    else:
        results = [ListResult(f"s{i:04d}", tokens[i, : lengths[i]].tolist(), logprobs[i, : lengths[i]].tolist())
                   for i in range(n)]
    lap("backend_out")
    results = pickle.loads(pickle.dumps(results, protocol=5))  # worker -> driver, as Dask moves a task's value
    lap("transfer")
    common = {"sample_id": [r.request_id for r in results], "prompt_ids": [[1, 2, 3]] * n,
              "advantage": [0.5] * n, "policy_version": [0] * n}
    if columnar:
        columns = {"response_ids": list_column([r.response_ids for r in results], pa.int32()),
                   "logprobs": list_column([r.logprobs for r in results], pa.float32())}
        table = pa.Table.from_pydict({**common, **columns}, schema=SCHEMA)
    else:
        table = pa.Table.from_pydict({**common, "response_ids": [r.response_ids for r in results],
                                      "logprobs": [r.logprobs for r in results]}, schema=SCHEMA)
    lap("store_rows")
    if columnar:
        batch = TrainBatch.from_arrow(table)
        targets, _ = padded(batch.response_ids)
        behaviour, _ = padded(batch.logprobs)
    else:
        rows = table.sort_by("sample_id")
        resp, lp = rows["response_ids"].to_pylist(), rows["logprobs"].to_pylist()
        width = max(len(r) for r in resp)
        targets, behaviour = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width))
        for i, (r, p) in enumerate(zip(resp, lp)):
            targets[i, : len(r)] = torch.tensor(r)
            behaviour[i, : len(p)] = torch.tensor(p)
    lap("trainer_in")
    out["total"] = sum(out.values())
    return out


def main(repeats: int) -> None:
    report = {"command": f"OMP_NUM_THREADS=1 .venv/bin/python docs/results/columnar_tokens_ab.py {repeats}",
              "torch_threads": torch.get_num_threads(), "sizes": {}}
    for label, (n, width) in SIZES.items():
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 49152, (n, width), generator=g)
        logprobs = -torch.rand((n, width), generator=g) * 5
        lengths = torch.randint(1, width + 1, (n,), generator=g).tolist()
        runs = {"lists": [], "columnar": []}
        for _ in range(repeats):
            for way in runs:  # interleaved
                runs[way].append(step(tokens, logprobs, lengths, columnar=way == "columnar"))
        report["sizes"][label] = {
            way: {stage: [round(statistics.median(r[stage] for r in rs), 3), round(min(r[stage] for r in rs), 3),
                          round(max(r[stage] for r in rs), 3)] for stage in rs[0]}
            for way, rs in runs.items()}
        print(label, json.dumps(report["sizes"][label]))
    with open("docs/results/columnar_tokens_ab.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
