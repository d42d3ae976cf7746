"""Seeded sampling that neither the batch nor the device changes: Gumbel-max with counter-based noise.

A request's token at decode step ``t`` is ``argmax_v(log p(v) + G(seed, t, v))``, where ``p`` is
``softmax(logits / T)`` and ``G`` is Gumbel noise made from a hash of (request seed, step, token id). The hash
is 32-bit integer arithmetic on tensors, on whatever device holds the logits, so it is exact on CPU and CUDA
alike: a response depends on its weights, prompt and seed only, not on the other rows of its batch, and no
logits leave the device to meet a per-request ``torch.Generator``. vLLM's model runner does the same inside a
Triton kernel.

The noise of one (seed, step) row is ``fmix32`` (murmur3's finaliser, computed exactly in int64 over the batch's
B keys) of the seed and step, xor-ed with a per-token table and mixed again by two multiply-xorshift rounds in
int32 arithmetic that wraps (``mix``), the cheap part over the (B, V) logits. Its top 23 bits are a uniform
``u`` in ``[2**-24, 1 - 2**-24]`` (as ``torch.rand``'s 24 bits were): tokens more than about 19.5 nats below the
row's most likely one can never be drawn, a truncation of under 2e-4 of the top token's probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

MASK32 = 0xFFFFFFFF
FMIX = (0x85EBCA6B, 0xC2B2AE35)  # murmur3's finaliser
MIX = (0x7FEB352D, 0x846CA68B)  # Wellons' lowbias32 multipliers, for the per-token rounds
STEP = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive steps apart before they are hashed
ONE_BITS = 0x3F800000  # float32 1.0: 23 random mantissa bits under it make a float in [1, 2)


def fmix32(x: int) -> int:
    """murmur3's 32-bit finaliser on a Python int (the reference the tensor versions are tested against)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * FMIX[0]) & MASK32
    x ^= x >> 13
    x = (x * FMIX[1]) & MASK32
    return x ^ (x >> 16)


def mix(x: int) -> int:
    """The per-token rounds of ``noise_bits`` on a Python int (its reference)."""
    x = (x * MIX[0]) & MASK32
    x ^= x >> 15
    return (x * MIX[1]) & MASK32


def seed_key(seed: int) -> int:
    """A request's 32-bit key: every bit of a seed up to 64 bits reaches it."""
    seed %= 1 << 64
    return fmix32((seed & MASK32) ^ fmix32((seed >> 32) ^ STEP))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32): in 16-bit halves of ``c``, so nothing overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """``fmix32`` on an int64 tensor of values in [0, 2**32), exactly."""
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX[0])
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX[1])
    return x ^ (x >> 16)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**32) as the int32 of the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _signed(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


@lru_cache(maxsize=8)
def token_table(vocab: int, device: torch.device) -> torch.Tensor:
    """``fmix32(v)`` for every token id ``v``, as int32 on ``device`` (made once per vocabulary and device)."""
    return _as_int32(_fmix32(torch.arange(vocab, dtype=torch.int64, device=device)))


def step_keys(keys: torch.Tensor, step: int) -> torch.Tensor:
    """Each row's key at decode step ``step``, as a (B, 1) int32 column; ``keys`` are the int64 ``seed_key``s."""
    return _as_int32(_fmix32(keys ^ ((step * STEP) & MASK32))).unsqueeze(-1)


def noise_bits(keys: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``mix(key ^ table[v])`` for every row and token into ``out`` (B, V) int32, in place.

    int32 multiplication wraps on CPU and CUDA (two's complement), so this equals ``mix`` on Python ints; a
    logical shift is an arithmetic one with the sign bits masked off.
    """
    x = torch.bitwise_xor(keys, table, out=out)
    x.mul_(_signed(MIX[0]))
    x.bitwise_xor_(x.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    return x.mul_(_signed(MIX[1]))


def uniforms(bits: torch.Tensor) -> torch.Tensor:
    """The top 23 of each int32's bits as a float32 in [2**-24, 1 - 2**-24], in place (a view of ``bits``)."""
    bits.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF).bitwise_or_(ONE_BITS)
    return bits.view(torch.float32).sub_(1 - 2**-24)  # exact: [1, 2) in steps of 2**-23, moved down


class SeededSampler:
    """Samples the next token of each request in a batch from ``softmax(logits / temperature)``.

    Args:
        seeds: each row's request seed.
        vocab: the logits' last dimension.
        device: where the logits are; keys, noise and results stay there.

    Example:
        >>> sampler = SeededSampler([7, 8], vocab=50, device=torch.device("cpu"))
        >>> tokens, logprobs = sampler(torch.randn(2, 50), step=0, temperature=1.0)
    """

    def __init__(self, seeds: Sequence[int], *, vocab: int, device: torch.device) -> None:
        self.keys = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64, device=device)
        self.table = token_table(vocab, device)
        self._bits = torch.empty((len(seeds), vocab), dtype=torch.int32, device=device)  # reused every step

    def __call__(self, logits: torch.Tensor, *, step: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (tokens (B,) int64, their log-probs (B,) float32); ``temperature`` 0 decodes greedily."""
        logits = logits.float()
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        if temperature > 0:
            u = uniforms(noise_bits(step_keys(self.keys, step), self.table, self._bits))
            gumbel = u.log_().neg_().log_().neg_()  # -log(-log u), in the noise's own buffer
            tokens = gumbel.add_(logp).argmax(dim=-1)
        else:
            tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
