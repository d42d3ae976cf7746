from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexmarl.models.loading import ModelError, check_model_setting, check_tokenizer_matches, load_model
from flexmarl.models.tiny import build_tokenizer


def test_tiny_model_round_trips_through_from_pretrained(tiny_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "Compute: 7 + 8 = 15, ünïcode"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert model.config.eos_token_id == tok.eos_token_id


def test_missing_or_wrong_model_paths(tmp_path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        check_model_setting(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        check_model_setting(str(tmp_path / "empty"))


def test_tokenizer_larger_than_the_embedding_table_is_refused(tiny_dir) -> None:
    model = load_model(tiny_dir)
    tok = build_tokenizer()
    tok.add_tokens([f"<extra{i}>" for i in range(10)])
    with pytest.raises(ModelError, match="does not belong to this model"):
        check_tokenizer_matches(model, tok, tiny_dir)


def test_builtin_tiny_sizes_share_a_tokenizer_and_differ_in_size(model_cache) -> None:
    from flexmarl.models.loading import load_tokenizer, resolve_model

    small, large = resolve_model("tiny"), resolve_model("tiny-large")
    assert load_tokenizer(small).get_vocab() == load_tokenizer(large).get_vocab()
    count = lambda d: sum(p.numel() for p in load_model(d).parameters())  # noqa: E731
    assert count(large) > 5 * count(small)
