"""A tiny Qwen2-style causal LM with a byte-level tokenizer, built offline for tests and quick runs.

The tokenizer has one token per byte plus the ChatML special tokens, so any text round-trips and no
training corpus is needed. The weights are a seeded random initialisation: the same seed gives the same
model on every machine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from flexmarl.models.names import TINY_SIZES

# Qwen2's own special tokens, so that AutoTokenizer (which picks Qwen2Tokenizer from the model type) adds none.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format SmolLM2-Instruct uses too, so prompts look alike for both models.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + 3 specials (vocab 259)."""
    byte_vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(
    tok: PreTrainedTokenizerFast, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, seed: int = 0
) -> Qwen2ForCausalLM:
    """A seeded random Qwen2 model for ``tok`` (about 0.1M parameters at the defaults)."""
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # building a model must not disturb the caller's RNG
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


# Built-in sizes: agents of different sizes share the tokenizer.
SIZES = TINY_SIZES


def save_tiny(out_dir: Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write a tiny model (``SIZES``) and its tokenizer as a Hugging Face directory."""
    tok = build_tokenizer()
    model = build_model(tok, seed=seed, **SIZES[size])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
