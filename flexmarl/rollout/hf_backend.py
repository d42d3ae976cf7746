"""Generation with Hugging Face transformers: batched, left-padded sampling on CPU or GPU."""

from __future__ import annotations

from collections.abc import Callable
from itertools import groupby
from pathlib import Path

import torch
from transformers import StaticCache

from flexmarl.models.loading import CACHE_ARG, check_tokenizer_matches, load_model, load_tokenizer
from flexmarl.models.prefix import Prefilled, prefill
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightUpdate, check_update
from flexmarl.rollout.config import Decode
from flexmarl.rollout.sampling import SeededSampler

STOP_CHECK_EVERY = 8
"""Decode steps between two checks, on an accelerator, of whether every row has finished."""
STATIC_LENGTH_STEP = 64
"""A static KV cache's length is the batch's prompt width plus its new tokens, rounded up to a multiple of this."""


class HFBackend:
    """One agent's rollout replica on a transformers model.

    Sampling is plain temperature sampling (no top-k/top-p), so the stored log-probs are those of the
    distribution the trainer re-scores. Sampling is seeded per request (see ``_generate_batch``).
    """

    def __init__(self, model_dir: str | Path, *, version: int = 0, device: str | None = None,
                 decode: Decode = "dynamic") -> None:
        self.device = torch.device(device) if device else self.default_device()
        self.decode = decode  # how a decode step runs (``rollout.decode``)
        self._compiled = None  # the compiled forward of 'compiled', made at its first use
        tok = load_tokenizer(Path(model_dir))
        self.pad_id = tok.pad_token_id
        self.eos_id = tok.eos_token_id
        self.model = load_model(Path(model_dir)).to(self.device).eval()
        check_tokenizer_matches(self.model, tok, Path(model_dir))
        self.version = version

    @property
    def stop_check_every(self) -> int:
        # On a CPU a check costs nothing; on an accelerator each is a sync that stalls the queue of kernels, and
        # the steps run past the last row's end are cheaper than a sync per step.
        return 1 if self.device.type == "cpu" else STOP_CHECK_EVERY

    @staticmethod
    def default_device() -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        key = lambda r: (r.max_new_tokens, r.temperature)  # noqa: E731 - requests sharing settings batch together
        for (max_new, temperature), group in groupby(sorted(requests, key=key), key=key):
            for result in self._generate_batch(list(group), max_new, temperature):
                results[result.request_id] = result
        return [results[r.request_id] for r in requests]

    def _generate_batch(
        self, requests: list[GenerationRequest], max_new_tokens: int, temperature: float
    ) -> list[GenerationResult]:
        """Decode the batch token by token with a KV cache.

        Each row samples with noise keyed by its request's seed (``sampling.SeededSampler``): a response
        depends only on (weights, prompt, seed), not on which other requests share its batch or which worker
        runs it. That is what lets the pipeline reproduce the synchronous schedule exactly.

        The prompts run through ``prefix.prefill``: the head they all share once, each distinct prompt once (a
        GRPO group's samples share theirs), keeping only the last position's logits. Everything the loop
        keeps stays on the model's device; it asks the device whether every row has finished once every
        ``stop_check_every`` steps, and copies the results to the host once, at the end.
        """
        B = len(requests)
        pre = prefill(self.model, [r.prompt_ids for r in requests], self.pad_id, self.device)
        last = pre.next_logits
        step = self._step(pre, max_new_tokens)
        sampler = SeededSampler([r.seed for r in requests], vocab=last.shape[-1], device=self.device)
        tokens = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, max_new_tokens), device=self.device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        for t in range(max_new_tokens):
            step_tokens, step_logprobs = sampler(last, step=t, temperature=temperature)
            step_tokens = torch.where(finished, self.pad_id, step_tokens)  # no boolean indexing: it syncs
            tokens[:, t] = step_tokens
            logprobs[:, t] = step_logprobs
            newly = (step_tokens == self.eos_id) & ~finished
            lengths = torch.where(newly, t + 1, lengths)
            finished |= newly
            if t == max_new_tokens - 1 or ((t + 1) % self.stop_check_every == 0 and bool(finished.all())):
                break
            last = step(step_tokens, t)
        # the one copy to the host; each result is a row's view
        tokens, logprobs = tokens.to("cpu", torch.int32).numpy(), logprobs.cpu().numpy()
        lengths, finished = lengths.tolist(), finished.tolist()
        return [
            GenerationResult(
                r.request_id,
                tokens[i, : lengths[i]],
                logprobs[i, : lengths[i]],
                "stop" if finished[i] else "length",
                self.version,
            )
            for i, r in enumerate(requests)
        ]

    def _step(self, pre: Prefilled, max_new_tokens: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The batch's decode step: ``step(tokens, t)`` feeds the tokens sampled at step ``t`` (B,) and returns
        the logits of the next ones (B, V). Each row continues at its own position (its prompt's length)."""
        B, width = pre.attention.shape
        positions = pre.next_position.unsqueeze(-1)  # (B, 1) the first new token's
        if self.decode == "dynamic":
            cache, attention = pre.cache, pre.attention

            def dynamic(tokens: torch.Tensor, t: int) -> torch.Tensor:
                nonlocal cache, attention
                attention = torch.cat([attention, attention.new_ones((B, 1))], dim=1)
                out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=attention, position_ids=positions + t,
                                 use_cache=True, **{CACHE_ARG: cache})
                cache = getattr(out, CACHE_ARG)
                return out.logits[:, -1, :]

            return dynamic
        # A static cache at the batch's full length (rounded up, so that compiled steps are reused across
        # batches), holding the prefilled keys and values; the mask marks the positions written so far.
        length = -(-(width + max_new_tokens) // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP
        static_cache = StaticCache(config=self.model.config, max_cache_len=length)
        prompt = {"cache_position": torch.arange(width, device=self.device)}
        for i, layer in enumerate(pre.cache.layers):
            static_cache.update(layer.keys, layer.values, i, prompt)
        mask = torch.zeros((B, length), dtype=pre.attention.dtype, device=self.device)
        mask[:, :width] = pre.attention
        cache_positions = torch.arange(width, length, device=self.device)  # sliced per step: no host transfer
        forward = self._compiled_forward() if self.decode == "compiled" else self.model.forward

        def static(tokens: torch.Tensor, t: int) -> torch.Tensor:
            mask[:, width + t] = 1
            out = forward(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=positions + t,
                          cache_position=cache_positions[t : t + 1], use_cache=True,
                          **{CACHE_ARG: static_cache})
            return out.logits[:, -1, :]

        return static

    def _compiled_forward(self) -> Callable:
        """The model's forward compiled once per backend (per input shape by torch): CUDA graphs on a GPU, whose
        launches are most of a small model's eager step. A weight update copies into the same tensors, so the
        graphs stay valid."""
        if self._compiled is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._compiled = torch.compile(self.model.forward, mode=mode, dynamic=False)
        return self._compiled

    def update_weights(self, update: WeightUpdate) -> None:
        check_update(update, self.model.state_dict(), self.version)
        with torch.no_grad():
            self.model.load_state_dict(update.state, strict=True)
        self.version = update.version
