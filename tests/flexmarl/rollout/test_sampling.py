from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexmarl.rollout.sampling import STEP, SeededSampler, fmix32, mix, noise_bits, seed_key, step_keys, token_table

CPU = torch.device("cpu")


@settings(max_examples=50, deadline=None)
@given(seeds=st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=4), step=st.integers(0, 70_000),
       vocab=st.integers(1, 300))
def test_the_noise_on_tensors_is_the_32_bit_hash_on_integers(seeds, step, vocab) -> None:
    """int32 multiplication wraps, and shifts are made logical: the tensor hash is the integer one, bit for bit."""
    keys = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64)
    out = torch.empty((len(seeds), vocab), dtype=torch.int32)
    bits = noise_bits(step_keys(keys, step), token_table(vocab, CPU), out)
    for row, seed in enumerate(seeds):
        key = fmix32(seed_key(seed) ^ ((step * STEP) & 0xFFFFFFFF))
        expected = [mix(key ^ fmix32(v)) for v in range(vocab)]
        assert [b & 0xFFFFFFFF for b in bits[row].tolist()] == expected


def test_a_seeds_tokens_do_not_depend_on_the_batch_around_them() -> None:
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, vocab, generator=g) * 2
    seeds = list(range(1000, 1256))
    batched = [SeededSampler(seeds, vocab=vocab, device=CPU)(logits, step=t, temperature=0.9) for t in range(3)]
    for row in (0, 17, 255):
        alone = SeededSampler([seeds[row]], vocab=vocab, device=CPU)
        for t, (tokens, logprobs) in enumerate(batched):
            one_tokens, one_logprobs = alone(logits[row : row + 1], step=t, temperature=0.9)
            assert one_tokens.item() == tokens[row].item()
            assert one_logprobs.item() == pytest.approx(logprobs[row].item(), abs=1e-6)
    # another seed, or another step, draws other tokens
    other = SeededSampler([s + 1 for s in seeds], vocab=vocab, device=CPU)(logits, step=0, temperature=0.9)[0]
    assert (other != batched[0][0]).float().mean() > 0.5
    assert (batched[1][0] != batched[0][0]).float().mean() > 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_draws_the_cpus_tokens() -> None:
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1)).double()  # equal logp on both
    seeds = list(range(64))
    cpu = SeededSampler(seeds, vocab=4096, device=CPU)(logits, step=5, temperature=1.0)[0]
    cuda = SeededSampler(seeds, vocab=4096, device=torch.device("cuda"))(logits.cuda(), step=5, temperature=1.0)[0]
    assert torch.equal(cpu, cuda.cpu())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_tokens_are_drawn_from_the_softmax_at_the_temperature() -> None:
    """A chi-square test of 40,000 draws over a vocabulary of 8, against softmax(logits / T); and the draws at
    two steps are independent (a chi-square test of their joint table against the product)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    n, temperature = 40_000, 0.7
    sampler = SeededSampler(range(n), vocab=8, device=CPU)
    first, logprobs = sampler(logits.expand(n, 8), step=0, temperature=temperature)
    second, _ = sampler(logits.expand(n, 8), step=1, temperature=temperature)
    probs = torch.softmax(logits / temperature, dim=-1)
    # chi-square critical values at p = 0.001: 24.32 for 7 degrees of freedom, 99.61 for 63
    assert chi_square(torch.bincount(first, minlength=8).double(), probs.double()) < 24.32
    assert chi_square(torch.bincount(second, minlength=8).double(), probs.double()) < 24.32
    joint = torch.bincount(first * 8 + second, minlength=64).double()
    assert chi_square(joint, torch.outer(probs, probs).flatten().double()) < 99.61
    assert torch.allclose(logprobs, torch.log(probs)[first], atol=1e-6)


def test_a_peaked_distribution_is_still_sampled_not_argmaxed() -> None:
    """The least likely token the noise can reach is about 19.5 nats below the top one: at 5 nats below,
    a token keeps its share."""
    logits = torch.tensor([0.0, -5.0])
    n = 200_000
    tokens, _ = SeededSampler(range(n), vocab=2, device=CPU)(logits.expand(n, 2), step=3, temperature=1.0)
    share = tokens.float().mean().item()
    expected = 1 / (1 + math.exp(5))
    assert share == pytest.approx(expected, rel=0.1)


def test_temperature_zero_is_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = SeededSampler(range(4), vocab=50, device=CPU)(logits, step=0, temperature=0)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_a_byte_vocabulary_is_sampled_at_the_softmaxs_frequencies() -> None:
    """100,000 draws over the tiny models' 259 tokens with one likely token and a long tail: a chi-square test
    against softmax(logits), tokens expected fewer than 5 times pooled (|z| < 4: p about 3e-5)."""
    vocab, n = 259, 100_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    logits[5] += 4.0
    tokens, _ = SeededSampler(range(n), vocab=vocab, device=CPU)(logits.expand(n, vocab), step=2, temperature=1.0)
    expected = torch.softmax(logits.double(), -1) * n
    counts = torch.bincount(tokens, minlength=vocab).double()
    big = expected >= 5
    chi = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    chi += float((counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum()) if (~big).any() else 0.0
    df = int(big.sum()) - (0 if (~big).any() else 1)
    assert abs(chi - df) / math.sqrt(2 * df) < 4, (chi, df)
