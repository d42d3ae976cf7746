"""Dynamic sampling's decision: which committed samples a micro-batch trains on."""

from __future__ import annotations

import pyarrow as pa

from flexmarl.rollout.scoring import trainable_samples, zero_variance_groups


def test_zero_variance_groups_are_those_with_equal_rewards_or_one_sample() -> None:
    keys = [("q0", "solver")] * 3 + [("q0", "verifier")] * 3 + [("q1", "solver")] * 2 + [("q2", "solver")]
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.3, 0.3, 0.7]
    assert zero_variance_groups(keys, rewards) == {("q0", "verifier"), ("q1", "solver"), ("q2", "solver")}
    assert zero_variance_groups([], []) == set()


def test_trainable_samples_drop_whole_zero_variance_groups_only_when_asked() -> None:
    rows = pa.table({
        "sample_id": ["a0", "a1", "b0", "b1", "c0", "c1"],
        "input_id": ["a", "a", "b", "b", "c", "c"],
        "node": ["solver"] * 6,
        "reward": [1.0, 0.0, 0.0, 0.0, 0.5, 1.0],
    })
    kept, dropped = trainable_samples(rows, dynamic_sampling=True)
    assert kept["sample_id"].to_pylist() == ["a0", "a1", "c0", "c1"] and dropped == 1
    kept, dropped = trainable_samples(rows, dynamic_sampling=False)
    assert kept["sample_id"].to_pylist() == rows["sample_id"].to_pylist() and dropped == 0
    # the same input at two nodes is two groups
    two_nodes = pa.table({"sample_id": ["x0", "x1", "y0", "y1"], "input_id": ["a"] * 4,
                          "node": ["solver", "solver", "verifier", "verifier"], "reward": [1.0, 1.0, 0.0, 1.0]})
    kept, dropped = trainable_samples(two_nodes, dynamic_sampling=True)
    assert kept["sample_id"].to_pylist() == ["y0", "y1"] and dropped == 1
    nothing, dropped = trainable_samples(rows.slice(2, 2), dynamic_sampling=True)
    assert nothing.num_rows == 0 and dropped == 1
