from __future__ import annotations

import math

import pytest
import torch

from flexmarl.training.losses import batch_normaliser, group_advantages, policy_loss


def test_group_advantages_match_a_plain_loop() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 2.0]
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    got = group_advantages(rewards, groups, eps=1e-6)
    for g in set(groups):
        vals = [r for r, k in zip(rewards, groups) if k == g]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        for r, k, a in zip(rewards, groups, got):
            if k == g:
                assert a == pytest.approx((r - mean) / (std + 1e-6))
    assert got[4] == got[5] == 0.0  # equal rewards: no signal
    assert got[6] == 0.0  # a group of one
    # exactly 0, not the rounding error of the mean (0.1 + 0.1 + 0.1 != 0.3), divided by std + eps
    assert group_advantages([0.1, 0.1, 0.1], ["a"] * 3) == [0.0, 0.0, 0.0]


def test_grpo_loss_by_hand() -> None:
    # two responses: lengths 2 and 1; ratios exp(0.1), exp(-0.5) | exp(0.3)
    logp = torch.tensor([[0.1, -0.5], [0.3, 0.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, loss_type="grpo")
    loss = loss / batch_normaliser("grpo", responses=2, tokens=3)
    # response 1 (A=+1): min(r, clip(r)) -> exp(0.1)=1.105 (inside), exp(-0.5)=0.607 (clip only bounds from
    # above for A>0, min picks 0.607); response 2 (A=-2): min(-2*1.35, -2*1.2) = -2.70
    t11, t12 = -math.exp(0.1), -math.exp(-0.5)
    t21 = 2 * math.exp(0.3)
    expected = ((t11 + t12) / 2 + t21) / 2
    assert float(loss) == pytest.approx(expected)
    # 0.607 (A>0) and 1.35 (A<0) are outside [0.8, 1.2], but on the side where the minimum keeps the
    # unclipped term (and its gradient): no token is clipped
    assert stats["clipfrac"] == 0.0

    dapo, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, loss_type="dapo")
    assert float(dapo) / batch_normaliser("dapo", responses=2, tokens=3) == pytest.approx((t11 + t12 + t21) / 3)

    # importance weights scale each token's loss
    weights = torch.tensor([[2.0, 1.0], [0.5, 1.0]], dtype=torch.float64)
    weighted, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, loss_type="dapo", is_weights=weights)
    assert float(weighted) == pytest.approx(2 * t11 + t12 + 0.5 * t21)


def test_clipfrac_counts_the_tokens_whose_clip_is_active_and_clip_higher_widens_the_top() -> None:
    # one response per case: ratio e^x against an advantage of sign s
    cases = [  # (log-ratio, advantage, clipped symmetric [0.8, 1.2], clipped with clip_eps_high=0.28)
        (math.log(1.25), 1.0, True, False),  # above 1.2 with A>0: clipped, but inside 1.28
        (math.log(1.30), 1.0, True, True),  # above 1.28 too
        (math.log(0.70), -1.0, True, True),  # below 0.8 with A<0: clipped on both settings
        (math.log(0.70), 1.0, False, False),  # below 0.8 with A>0: the unclipped term is the minimum
        (math.log(1.30), -1.0, False, False),  # above with A<0: likewise (no dual clip)
        (math.log(1.10), 1.0, False, False),  # inside
    ]
    logp = torch.tensor([[c[0]] for c in cases], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    mask = torch.ones_like(logp)
    for high, column in ((None, 2), (0.28, 3)):
        loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=high, loss_type="dapo")
        (grad,) = torch.autograd.grad(loss, logp)
        clipped = [c[column] for c in cases]
        assert stats["clipfrac"] == pytest.approx(sum(clipped) / len(cases)), high
        # a clipped token has no gradient, every other one has -A * ratio
        for g, (x, a, *_), is_clipped in zip(grad[:, 0].tolist(), cases, clipped):
            assert g == (0.0 if is_clipped else pytest.approx(-a * math.exp(x))), (high, x, a)
    # the clipped value itself: (1 + 0.28) * A for the ratio 1.30 with A>0
    token, _ = policy_loss(logp[1:2], old[1:2], adv[1:2], mask[1:2], clip_eps=0.2, clip_eps_high=0.28, loss_type="dapo")
    assert float(token.detach()) == pytest.approx(-1.28)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_gradients_equal_the_full_batch_gradient(loss_type: str) -> None:
    torch.manual_seed(0)
    batch, width = 7, 5
    logits = torch.randn(batch, width, dtype=torch.float64, requires_grad=True)
    old = torch.randn(batch, width, dtype=torch.float64) * 0.1
    adv = torch.randn(batch, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2, 3])
    mask = (torch.arange(width) < lengths.unsqueeze(1)).double()
    max_len = 9  # the agent's max_new_tokens (dr_grpo's constant), longer than any response here
    norm = batch_normaliser(loss_type, responses=batch, tokens=int(mask.sum()), max_len=max_len)

    # the full-batch loss, written out directly: mean of per-response means (grpo), token mean (dapo), or
    # the token sum over responses x max_new_tokens (dr_grpo)
    ratio = torch.exp(logits * 0.1 - old)
    token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    if loss_type == "grpo":
        full = ((token * mask).sum(-1) / mask.sum(-1)).mean()
    elif loss_type == "dapo":
        full = (token * mask).sum() / mask.sum()
    else:
        full = (token * mask).sum() / (batch * max_len)
    (g_full,) = torch.autograd.grad(full, logits)

    g_acc = torch.zeros_like(logits)
    for start in range(0, batch, 3):  # uneven micro-batches: 3, 3, 1
        sl = slice(start, start + 3)
        part, _ = policy_loss(logits[sl] * 0.1, old[sl], adv[sl], mask[sl], clip_eps=0.2, loss_type=loss_type)
        (g,) = torch.autograd.grad(part, logits)
        g_acc += g
    g_acc /= norm  # divided once, when the global batch is complete
    assert torch.max(torch.abs(g_acc - g_full)) < 1e-10


def test_advantage_variants() -> None:
    from flexmarl.training.losses import agent_scaled

    rewards, groups = [1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]
    assert group_advantages(rewards, groups, scale=False) == [0.5, -0.5, 0.0, 0.0]  # Dr. GRPO: centred only
    centred = group_advantages(rewards, groups, scale=False)
    std = torch.tensor(rewards, dtype=torch.float64).std().item()
    assert agent_scaled(centred, rewards, eps=0.0) == pytest.approx([c / std for c in centred])


def test_dr_grpo_divides_by_a_constant_and_kl_is_k3() -> None:
    from flexmarl.training.losses import k3_kl

    assert batch_normaliser("dr_grpo", responses=4, tokens=37, max_len=16) == 64
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    assert torch.equal(k3_kl(logp, logp), torch.zeros_like(logp))
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    d = ref - logp
    assert torch.allclose(k3_kl(logp, ref), torch.exp(d) - d - 1) and bool((k3_kl(logp, ref) > 0).all())
    mask = torch.ones_like(logp)
    adv = torch.tensor([0.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, logp, adv, mask, clip_eps=0.2, loss_type="dapo", ref_logprobs=ref, kl_coef=0.5)
    assert float(loss) == pytest.approx(0.5 * float(k3_kl(logp, ref).sum()))
    assert stats["kl"] == pytest.approx(float(k3_kl(logp, ref).mean()))
