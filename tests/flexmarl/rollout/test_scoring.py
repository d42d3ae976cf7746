"""Dynamic sampling's decision: which committed samples a micro-batch trains on; the token columns' way from
the rollout's arrays to the trainer's tensors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl.rollout.scoring import list_column, signal_free_groups, trainable_samples
from flexmarl.training.trainer import TrainBatch


def test_signal_free_groups_are_those_whose_advantages_are_all_zero() -> None:
    keys = [("q0", "solver")] * 3 + [("q0", "verifier")] * 3 + [("q1", "solver")] * 2 + [("q2", "solver")]
    advantages = [0.5, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert signal_free_groups(keys, advantages) == {("q0", "verifier"), ("q1", "solver"), ("q2", "solver")}
    assert signal_free_groups([], []) == set()


def test_trainable_samples_drop_whole_zero_variance_groups_only_when_asked() -> None:
    rows = pa.table({
        "sample_id": ["a0", "a1", "b0", "b1", "c0", "c1"],
        "input_id": ["a", "a", "b", "b", "c", "c"],
        "node": ["solver"] * 6,
        "advantage": [0.7, -0.7, 0.0, 0.0, -0.7, 0.7],
    })
    kept, dropped = trainable_samples(rows, dynamic_sampling=True)
    assert kept["sample_id"].to_pylist() == ["a0", "a1", "c0", "c1"] and dropped == 1
    kept, dropped = trainable_samples(rows, dynamic_sampling=False)
    assert kept["sample_id"].to_pylist() == rows["sample_id"].to_pylist() and dropped == 0
    # the same input at two nodes is two groups
    two_nodes = pa.table({"sample_id": ["x0", "x1", "y0", "y1"], "input_id": ["a"] * 4,
                          "node": ["solver", "solver", "verifier", "verifier"], "advantage": [0.0, 0.0, -0.7, 0.7]})
    kept, dropped = trainable_samples(two_nodes, dynamic_sampling=True)
    assert kept["sample_id"].to_pylist() == ["y0", "y1"] and dropped == 1
    nothing, dropped = trainable_samples(rows.slice(2, 2), dynamic_sampling=True)
    assert nothing.num_rows == 0 and dropped == 1


responses = st.lists(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.floats(-50, 0, width=32)), max_size=9),
                     min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(responses, st.randoms(use_true_random=False), st.integers(1, 3))
def test_tokens_and_logprobs_reach_the_trainer_exactly_through_arrow_columns(rows, rng, chunks: int) -> None:
    """The rollout's arrays become Arrow list columns (``list_column``) and come back as the trainer's tensors
    (``TrainBatch.from_arrow``), bit for bit, in sample-id order, empty answers and many chunks included."""
    ids = [np.array([t for t, _ in r], dtype=np.int32) for r in rows]
    lps = [np.array([lp for _, lp in r], dtype=np.float32) for r in rows]
    names = [f"s{i:02d}" for i in range(len(rows))]
    order = list(range(len(rows)))
    rng.shuffle(order)  # stored in any order, trained sorted by sample id
    table = pa.table({
        "sample_id": [names[i] for i in order],
        "prompt_ids": [[1, 2]] * len(rows),
        "response_ids": list_column([ids[i] for i in order], pa.int32()),
        "logprobs": list_column([lps[i] for i in order], pa.float32()),
        "advantage": [0.5] * len(rows),
        "policy_version": [0] * len(rows),
    })
    cut = sorted({0, table.num_rows, *(rng.randrange(table.num_rows + 1) for _ in range(chunks - 1))})
    table = pa.concat_tables([table.slice(a, b - a) for a, b in zip(cut, cut[1:], strict=False)])
    batch = TrainBatch.from_arrow(table)
    assert batch.sample_ids == names
    for i in range(len(rows)):
        assert batch.response_ids[i].dtype == torch.int32 and batch.logprobs[i].dtype == torch.float32
        assert batch.response_ids[i].tolist() == ids[i].tolist()
        assert batch.logprobs[i].numpy().tobytes() == lps[i].tobytes()
