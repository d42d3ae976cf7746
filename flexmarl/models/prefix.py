"""Shared-prefix prefill: run a batch's prompts through a causal LM, computing each shared token once.

A GRPO batch repeats itself: every prompt starts with the same chat template and system message, a group's
samples share their whole prompt, and a verifier's prompts differ only in the answer they quote. ``prefill``
runs the head all prompts share once (one row), each distinct prompt's remainder once (one row per distinct
prompt, left-padded after the head), and copies the KV cache to one row per request. What follows (the
rollout's decode loop, the trainer's answer tokens) runs per request on that cache. Positions count each
prompt's own tokens, so the result equals running every prompt alone, up to float rounding; gradients reach
the shared tokens from every row that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flexmarl.models.loading import CACHE_ARG

MIN_HEAD = 4
"""A shared head shorter than this is not run apart: one more forward would cost more than it saves."""


@dataclass
class Prefilled:
    """A batch's prompts, run: one row per request, ready for the next tokens."""

    cache: object  # the model's KV cache (transformers' Cache), one row per request
    attention: torch.Tensor  # (B, width) 1 where the cache holds a prompt token, 0 at padding
    next_logits: torch.Tensor  # (B, V) the logits after each request's prompt: they predict its first token
    next_position: torch.Tensor  # (B,) each request's prompt length: the position of its first new token


def common_head(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens all prompts start with, leaving each at least one of its own (whose logits predict its first
    new token)."""
    shortest = min(len(p) for p in prompts)
    head = 0
    while head < shortest - 1 and all(p[head] == prompts[0][head] for p in prompts):
        head += 1
    return head


def shared_head(distinct: Sequence[Sequence[int]]) -> int:
    """The head ``prefill`` runs apart for these distinct prompts: their common head, or 0 when there is one
    prompt or the head is shorter than ``MIN_HEAD``."""
    head = common_head(distinct) if len(distinct) > 1 else 0
    return head if head >= MIN_HEAD else 0


def prefill_positions(prompts: Sequence[Sequence[int]]) -> int:
    """Positions ``prefill`` computes for ``prompts``: the shared head once, each distinct prompt's rest once."""
    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    head = shared_head(distinct)
    return head + sum(len(p) - head for p in distinct)


def saves_work(prompts: Sequence[Sequence[int]]) -> bool:
    """Whether ``prefill`` computes fewer positions than running each prompt whole: a prompt repeats, or all
    share a head of at least ``MIN_HEAD`` tokens."""
    return prefill_positions(prompts) < sum(len(p) for p in prompts)


def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Prefilled:
    """Run ``prompts`` (one per request, repeats allowed) through ``model``; see the module doc.

    The model is called with ``use_cache=True`` and ``logits_to_keep=1``, under whatever grad mode the
    caller set: the trainer backpropagates through the result, the rollout backend does not.
    """
    distinct: dict[tuple[int, ...], int] = {}
    row_of = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
    unique = list(distinct)
    head = shared_head(unique)
    cache = None
    if head:
        out = model(input_ids=torch.tensor([unique[0][:head]], device=device), use_cache=True)
        cache = getattr(out, CACHE_ARG)
        cache.batch_repeat_interleave(len(unique))
    tails = [u[head:] for u in unique]
    width = max(len(t) for t in tails)
    ids = torch.full((len(unique), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(unique), head + width), dtype=torch.long)
    mask[:, :head] = 1
    for i, tail in enumerate(tails):  # left padding after the head: every prompt ends at the last column
        ids[i, width - len(tail) :] = torch.tensor(tail)
        mask[i, head + width - len(tail) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, head:]  # each prompt's own token count, padding aside
    mask, ids, positions = mask.to(device), ids.to(device), positions.to(device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **({CACHE_ARG: cache} if cache is not None else {}))
    cache = getattr(out, CACHE_ARG)
    lengths = torch.tensor([len(u) for u in unique], device=device)
    if len(unique) < len(prompts):  # one row per request from here on
        cache.batch_select_indices(row_of)
    return Prefilled(cache, mask[row_of], out.logits[:, -1, :][row_of], lengths[row_of])
