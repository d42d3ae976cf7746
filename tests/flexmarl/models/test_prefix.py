"""Shared-prefix prefill: which tokens are shared, and that the result equals running each prompt alone."""

from __future__ import annotations

import torch

from flexmarl.models.loading import CACHE_ARG, load_model
from flexmarl.models.prefix import MIN_HEAD, common_head, prefill, saves_work


def test_the_common_head_leaves_every_prompt_a_token_of_its_own() -> None:
    assert common_head([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert common_head([[1, 2, 3], [1, 2, 3, 4, 5]]) == 2  # the shorter keeps its last token
    assert common_head([[1, 2], [3, 4]]) == 0
    assert saves_work([[1, 2], [1, 2]]) and not saves_work([[1, 2], [3, 4]])
    assert saves_work([[9] * MIN_HEAD + [1], [9] * MIN_HEAD + [2]])
    assert not saves_work([[9] * (MIN_HEAD - 1) + [1], [9] * (MIN_HEAD - 1) + [2]])


def test_prefill_gives_each_request_the_logits_of_its_prompt_run_alone(tiny_dir) -> None:
    model = load_model(tiny_dir).eval()
    head = [257, 5, 6, 7, 8]
    prompts = [head + [11, 12], head + [20], head + [11, 12], head + [30, 31, 32, 33]]
    cpu = torch.device("cpu")
    with torch.no_grad():
        pre = prefill(model, prompts, 0, cpu)
        alone = [model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]
        # the next token goes on each row's cache at its own position, as it would after the prompt alone
        step = model(input_ids=torch.full((4, 1), 40), attention_mask=torch.cat([pre.attention, torch.ones(4, 1,
                     dtype=torch.long)], dim=1), position_ids=pre.next_position[:, None], use_cache=True,
                     **{CACHE_ARG: pre.cache}).logits[:, -1]
        after = [model(input_ids=torch.tensor([p + [40]])).logits[0, -1] for p in prompts]
    assert pre.next_position.tolist() == [len(p) for p in prompts]
    assert pre.attention.shape == (4, len(head) + 4) and pre.attention.sum(1).tolist() == [len(p) for p in prompts]
    for i in range(4):
        assert torch.allclose(pre.next_logits[i], alone[i], atol=1e-5)
        assert torch.allclose(step[i], after[i], atol=1e-5)
