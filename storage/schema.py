"""Arrow schemas of the MEG Store tables: the one definition of every stored column.

Small values are stored inline; token ids and log-probs are Arrow list columns. Nothing is pickled.
"""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")


class SampleStatus(StrEnum):
    """Life cycle of a sample row. Consumption is recorded in the updates table, not by rewriting rows."""

    GENERATED = "generated"  # sampled, reward not known yet
    REWARDED = "rewarded"  # reward and advantage filled: visible to training


# One row per agent invocation (a node of one episode). One table per agent.
SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # f"{input_id}_{turn}_{trajectory_id}"
        pa.field("episode_id", pa.string(), nullable=False),  # f"{input_id}_{trajectory_id}"
        pa.field("input_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),  # position of the node in the episode's graph order
        pa.field("trajectory_id", pa.int32(), nullable=False),  # index inside the GRPO group
        pa.field("node", pa.string(), nullable=False),
        pa.field("agent", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),  # training step whose batch this sample belongs to
        pa.field("policy_version", pa.int64(), nullable=False),  # weights that generated it
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),  # rollout log-prob of each response token
        pa.field("finish_reason", pa.string()),  # "stop" (EOS) or "length"
        pa.field("parsed", pa.string()),  # the output parser's value; null when the output did not parse
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("parent_ids", pa.list_(pa.string()), nullable=False),  # sample ids this one was conditioned on
        pa.field("created_at", TIMESTAMP, nullable=False),
    ]
)

# One row per episode (one trajectory of the MEG for one input).
EPISODE_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("input_id", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.int32(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("task", pa.string(), nullable=False),  # the workload item as JSON text
        pa.field("node_status", pa.map_(pa.string(), pa.string()), nullable=False),
        pa.field("rewards", pa.map_(pa.string(), pa.float64()), nullable=False),  # node -> reward
        pa.field("outcome", pa.string(), nullable=False),  # "completed" or "failed"
        pa.field("error", pa.string()),
        pa.field("created_at", TIMESTAMP, nullable=False),
    ]
)

# One row per optimizer step of one agent: the consumption record and the version bump in one commit.
UPDATE_SCHEMA = pa.schema(
    [
        pa.field("agent", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),  # the version this update produced
        pa.field("consumed_ids", pa.list_(pa.string()), nullable=False),
        pa.field("samples_version", pa.int64(), nullable=False),  # Delta version of the sample table read
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("checkpoint_uri", pa.string()),
        pa.field("metrics", pa.map_(pa.string(), pa.float64()), nullable=False),
        pa.field("created_at", TIMESTAMP, nullable=False),
    ]
)
