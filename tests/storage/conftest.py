"""Store fixtures: a two-agent store under tmp_path and a builder of sample rows.

Scripts run in subprocesses import ``rows`` from here after putting this directory on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from storage.schema import SAMPLE_SCHEMA, SampleStatus
from storage.store import ExperienceStore


def rows(
    agent: str,
    ids: list[str],
    *,
    policy_version: int = 0,
    step: int = 0,
    status: SampleStatus = SampleStatus.REWARDED,
    parents: list[list[str]] | None = None,
) -> pa.Table:
    """Sample rows of ``agent`` with the given ids; ``parents[i]`` are the parent ids of row i."""
    return pa.Table.from_pylist(
        [
            {
                "sample_id": sid, "episode_id": sid.rsplit("_", 1)[0], "input_id": "q", "turn": 0,
                "trajectory_id": i, "node": agent, "agent": agent, "step": step, "policy_version": policy_version,
                "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "logprobs": [-0.5, -1.5], "finish_reason": "stop",
                "parsed": "4", "reward": 1.0, "advantage": 0.5, "status": status.value,
                "parent_ids": parents[i] if parents else [], "created_at": datetime.now(UTC),
            }
            for i, sid in enumerate(ids)
        ],
        schema=SAMPLE_SCHEMA,
    )


@pytest.fixture
def make_rows():
    return rows


@pytest.fixture
def store(tmp_path) -> ExperienceStore:
    s = ExperienceStore(tmp_path / "store")
    s.create(["solver", "verifier"])
    return s


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import rows  # this file
from storage.store import ExperienceStore
store = ExperienceStore({root!r}{store_args})
for k in range({commits}):
    store.append_samples("solver", rows("solver", [f"w{writer}c{{k}}_0_0"]), app_id="w{writer}", seq=k + 1)
"""


@pytest.fixture
def writer_processes() -> Callable[..., list[int]]:
    """Run ``writers`` processes that each append ``commits`` one-row batches to ``root``; their exit codes.

    ``store_args`` is extra constructor text for the store, e.g. ``", compact_after_files=3"``.
    """

    def run(root: str, *, writers: int, commits: int, store_args: str = "") -> list[int]:
        tests = str(Path(__file__).parent)
        procs = [
            subprocess.Popen([sys.executable, "-c", WRITER.format(
                tests=tests, root=root, store_args=store_args, commits=commits, writer=w)])
            for w in range(writers)
        ]
        return [p.wait(timeout=300) for p in procs]

    return run
