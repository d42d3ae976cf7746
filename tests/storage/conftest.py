"""Store fixtures: a two-agent store under tmp_path and a builder of sample rows.

Scripts run in subprocesses import ``rows`` from here after putting this directory on ``sys.path``.
"""

from __future__ import annotations

from datetime import UTC, datetime

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
