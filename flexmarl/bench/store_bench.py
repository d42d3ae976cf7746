"""How fast the MEG Store commits micro-batches and serves them back (``flexmarl bench store``).

Two stores take the same stream of micro-batch commits (one per rollout micro-batch, as the pipeline mode
will commit them): one never compacts, the other compacts automatically past ``compact_after_files``. The
report gives each one's append latency (p50, p99, max), its rows/s, and the latency of the trainers' read
(``read_micro_batch``): one committed micro-batch by its sample ids, at the Delta version it was committed in.

Example:
    >>> report = run_store_bench("/tmp/bench", commits=20)
    >>> sorted(report["append"])
    ['auto_compaction', 'no_compaction']
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from storage.schema import SAMPLE_SCHEMA, SampleStatus
from storage.store import ExperienceStore

AGENT = "solver"


def synthetic_samples(
    start: int, n: int, *, policy_version: int, prompt_len: int, response_len: int, rng: np.random.Generator
) -> pa.Table:
    """``n`` rewarded sample rows of one micro-batch, with token ids and log-probs of realistic lengths."""
    inputs = [f"q{(start + i) // 8:07d}" for i in range(n)]  # GRPO groups of 8 trajectories per input
    trajs = [(start + i) % 8 for i in range(n)]
    prompts = rng.integers(0, 50_000, size=(n, prompt_len), dtype=np.int32)
    responses = rng.integers(0, 50_000, size=(n, response_len), dtype=np.int32)
    logprobs = -rng.random((n, response_len), dtype=np.float32)
    now = datetime.now(UTC)
    columns = {
        "sample_id": [f"{q}_0_{t}" for q, t in zip(inputs, trajs)],
        "episode_id": [f"{q}_{t}" for q, t in zip(inputs, trajs)],
        "input_id": inputs,
        "turn": [0] * n,
        "trajectory_id": trajs,
        "node": [AGENT] * n,
        "agent": [AGENT] * n,
        "step": [policy_version] * n,
        "policy_version": [policy_version] * n,
        "prompt_ids": pa.FixedSizeListArray.from_arrays(prompts.ravel(), prompt_len).cast(pa.list_(pa.int32())),
        "response_ids": pa.FixedSizeListArray.from_arrays(responses.ravel(), response_len).cast(pa.list_(pa.int32())),
        "logprobs": pa.FixedSizeListArray.from_arrays(logprobs.ravel(), response_len).cast(pa.list_(pa.float32())),
        "finish_reason": ["stop"] * n,
        "parsed": ["42"] * n,
        "reward": rng.random(n),
        "advantage": rng.standard_normal(n),
        "status": [SampleStatus.REWARDED.value] * n,
        "parent_ids": [[] for _ in range(n)],
        "created_at": [now] * n,
    }
    return pa.table(columns, schema=SAMPLE_SCHEMA)


def _latency(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1000
    return {
        "n": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "mean_ms": round(float(ms.mean()), 2),
        "max_ms": round(float(ms.max()), 2),
    }


def _append_phase(root: str, *, commits: int, rows: int, batches_per_version: int, compact_after_files: int,
                  prompt_len: int, response_len: int, seed: int) -> tuple[ExperienceStore, dict]:
    store = ExperienceStore(root, compact_after_files=compact_after_files)
    store.create([AGENT])
    rng = np.random.default_rng(seed)
    batches = [
        synthetic_samples(k * rows, rows, policy_version=k // batches_per_version, prompt_len=prompt_len,
                          response_len=response_len, rng=rng)
        for k in range(commits)
    ]  # built before timing: only the commits are measured
    times = []
    t0 = time.perf_counter()
    for k, batch in enumerate(batches):
        t = time.perf_counter()
        store.append_samples(AGENT, batch, app_id=f"rollout:{AGENT}", seq=k + 1)
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    tenths = max(1, commits // 10)
    info = store.describe()["tables"][store.samples_table(AGENT)]
    history = store.open(store.samples_table(AGENT)).history()
    return store, {
        "compact_after_files": compact_after_files,
        "latency": _latency(times),
        "first_tenth": _latency(times[:tenths]),  # how latency drifts as the table grows
        "last_tenth": _latency(times[-tenths:]),
        "rows_per_s": round(commits * rows / total, 1),
        "wall_s": round(total, 2),
        "compactions": sum(h.get("operation") == "OPTIMIZE" for h in history),
        "final_files": info["files"],
        "final_rows": info["rows"],
        "delta_version": info["version"],
    }


def _read_phase(store: ExperienceStore, *, rows: int, reads: int) -> dict:
    """Read committed micro-batches back as a trainer does: ``rows`` sample ids at their commit's version."""
    table = store.read_samples(AGENT, columns=["sample_id"])
    ids = sorted(table["sample_id"].to_pylist())
    pinned = store.version(store.samples_table(AGENT))
    times, served = [], 0
    for i in range(reads):
        start = (i * rows) % max(len(ids) - rows + 1, 1)  # spread over the table, wrapping around
        t = time.perf_counter()
        batch = store.read_micro_batch(AGENT, ids[start:start + rows], version=pinned)
        times.append(time.perf_counter() - t)
        served += batch.num_rows
    return {"latency": _latency(times), "n": rows, "rows_served": served}


def run_store_bench(
    workdir: str | os.PathLike,
    *,
    commits: int = 1000,
    rows_per_commit: int = 64,
    batches_per_version: int = 16,
    compact_after_files: int = 200,
    reads: int = 50,
    prompt_len: int = 128,
    response_len: int = 128,
    seed: int = 0,
) -> dict:
    """Measure append and micro-batch read latency of the store under ``workdir`` (a scratch folder, removed after).

    Args:
        commits: micro-batch commits per store.
        rows_per_commit: rows per micro-batch.
        batches_per_version: micro-batches per global batch (the policy version advances after each).
        compact_after_files: the automatic-compaction threshold of the compacting store.
        reads: ``read_micro_batch`` calls timed on each store.
        prompt_len, response_len: token ids per prompt and response (the payload size).

    Returns:
        The report: ``config``, ``append`` (``no_compaction``, ``auto_compaction``) and ``read`` (same keys).
    """
    if commits < 2:
        raise ValueError(f"commits must be >= 2, got {commits}")
    scratch = tempfile.mkdtemp(prefix="store-bench-", dir=workdir)
    report: dict = {
        "config": {
            "commits": commits, "rows_per_commit": rows_per_commit, "batches_per_version": batches_per_version,
            "compact_after_files": compact_after_files, "reads": reads, "prompt_len": prompt_len,
            "response_len": response_len, "cpus": os.cpu_count(), "python": platform.python_version(),
            "pyarrow": pa.__version__,
        },
        "append": {},
        "read": {},
    }
    try:
        for name, threshold in (("no_compaction", 0), ("auto_compaction", compact_after_files)):
            store, append = _append_phase(
                os.path.join(scratch, name), commits=commits, rows=rows_per_commit,
                batches_per_version=batches_per_version, compact_after_files=threshold, prompt_len=prompt_len,
                response_len=response_len, seed=seed,
            )
            report["append"][name] = append
            report["read"][name] = _read_phase(store, rows=rows_per_commit, reads=reads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report["summary"] = {
        "append_p50_ms": {k: v["latency"]["p50_ms"] for k, v in report["append"].items()},
        "append_p99_ms": {k: v["latency"]["p99_ms"] for k, v in report["append"].items()},
        "rows_per_s": {k: v["rows_per_s"] for k, v in report["append"].items()},
        "read_p50_ms": {k: v["latency"]["p50_ms"] for k, v in report["read"].items()},
        "read_p99_ms": {k: v["latency"]["p99_ms"] for k, v in report["read"].items()},
    }
    return report
