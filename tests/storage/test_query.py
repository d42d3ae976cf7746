"""query_samples and episode_samples: which rows, in which order, from a real store."""

from __future__ import annotations

import pyarrow as pa
import pytest

from storage.query import episode_record, episode_samples, query_samples
from storage.store import ExperienceStore, StoreError
from storage.where import FilterError


@pytest.fixture
def filled(store: ExperienceStore, make_rows) -> ExperienceStore:
    """Two steps of 3 episodes: solver at turn 0, verifier (its child) at turn 1; rewards vary by trajectory."""
    for step in (0, 1):
        for agent, turn in (("solver", 0), ("verifier", 1)):
            ids = [f"s{step}q_{turn}_{t}" for t in range(3)]
            rows = make_rows(agent, ids, policy_version=step, step=step).to_pylist()
            for t, row in enumerate(rows):
                row.update(episode_id=f"s{step}q_{t}", turn=turn, reward=float(t) - 1.0,
                           parent_ids=[f"s{step}q_0_{t}"] if turn else [])
            store.append_samples(agent, pa.Table.from_pylist(rows, schema=store.read_samples(agent).schema),
                                 app_id=f"test:{agent}", seq=step + 1)
    return store


def test_query_filters_by_where_and_version_in_step_episode_order(filled: ExperienceStore) -> None:
    rows = query_samples(filled, "solver", where="reward >= 0")
    assert rows["sample_id"].to_pylist() == ["s0q_0_1", "s0q_0_2", "s1q_0_1", "s1q_0_2"]
    assert query_samples(filled, "solver", where="reward >= 0", policy_version=1)["sample_id"].to_pylist() == [
        "s1q_0_1", "s1q_0_2"]
    assert query_samples(filled, "verifier", limit=2)["sample_id"].to_pylist() == ["s0q_1_0", "s0q_1_1"]


def test_query_refuses_an_unknown_agent_and_a_bad_filter(filled: ExperienceStore) -> None:
    with pytest.raises(StoreError, match="no agent 'planner'.*agents: solver, verifier"):
        query_samples(filled, "planner")
    with pytest.raises(FilterError, match="unknown column 'score'"):
        query_samples(filled, "solver", where="score > 0")


def test_an_episode_reads_every_agent_in_turn_order(filled: ExperienceStore) -> None:
    rows = episode_samples(filled, "s1q_2")
    assert rows["agent"].to_pylist() == ["solver", "verifier"]
    assert rows["sample_id"].to_pylist() == ["s1q_0_2", "s1q_1_2"]
    assert rows["parent_ids"].to_pylist()[1] == ["s1q_0_2"]
    assert episode_record(filled, "s1q_2") is None  # no episodes row committed in this store
    with pytest.raises(StoreError, match="no samples of episode 'nope'.*look like 's[01]q_[0-2]'"):
        episode_samples(filled, "nope")
