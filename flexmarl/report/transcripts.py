"""Stored samples as people read them: prompt and response token ids decoded into text.

The prompt is decoded with its special tokens, so it reads exactly as the agent saw it (chat template
included); the response without them (its end-of-turn token says only that it stopped, which
``finish_reason`` already records).

Example:
    >>> decode_samples(query_samples(store, "solver", limit=1), {"solver": tok})[0]["response"]
    'The answer is 7.'
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import pyarrow as pa
from transformers import PreTrainedTokenizerBase

# the columns shown, in order; token ids and log-probs are replaced by the decoded text
COLUMNS = ["sample_id", "episode_id", "agent", "node", "turn", "step", "policy_version", "status", "finish_reason",
           "parsed", "reward", "advantage", "parent_ids", "created_at"]


def decode_samples(rows: pa.Table, tokenizers: Mapping[str, PreTrainedTokenizerBase]) -> list[dict]:
    """One dict per row: ``COLUMNS`` plus ``prompt`` and ``response`` text (timestamps as ISO 8601)."""
    out = []
    for row in rows.to_pylist():
        tok = tokenizers[row["agent"]]
        item = {c: row[c] for c in COLUMNS}
        if isinstance(item["created_at"], datetime):
            item["created_at"] = item["created_at"].isoformat()
        item["prompt"] = tok.decode(row["prompt_ids"], skip_special_tokens=False)
        item["response"] = tok.decode(row["response_ids"], skip_special_tokens=True)
        item["response_tokens"] = len(row["response_ids"])
        out.append(item)
    return out
