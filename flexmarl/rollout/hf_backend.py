"""Generation with Hugging Face transformers: batched, left-padded sampling on CPU or GPU."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

import torch

from flexmarl.models.loading import check_tokenizer_matches, load_model, load_tokenizer
from flexmarl.rollout.backend import GenerationRequest, GenerationResult, WeightSyncError, WeightUpdate


class HFBackend:
    """One agent's rollout replica on a transformers model.

    Sampling is plain temperature sampling (no top-k/top-p), so the stored log-probs are those of the
    distribution the trainer re-scores.
    """

    def __init__(self, model_dir: str | Path, *, version: int = 0, device: str | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tok = load_tokenizer(Path(model_dir))
        self.pad_id = tok.pad_token_id
        self.eos_id = tok.eos_token_id
        self.model = load_model(Path(model_dir)).to(self.device).eval()
        check_tokenizer_matches(self.model, tok, Path(model_dir))
        self.version = version

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
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every prompt ends at column `width`
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        torch.manual_seed(requests[0].seed)
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_tokens = out.sequences[:, width:].cpu()  # (B, T)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B, T, V), raw: before temperature
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        for i, r in enumerate(requests):
            tokens = new_tokens[i].tolist()
            if self.eos_id in tokens:
                length, finish = tokens.index(self.eos_id) + 1, "stop"
            else:
                length, finish = len(tokens), "length"
            results.append(
                GenerationResult(r.request_id, tokens[:length], logprobs[i, :length].tolist(), finish, self.version)
            )
        return results

    def update_weights(self, update: WeightUpdate) -> None:
        current = self.model.state_dict()
        problems = [f"missing {name}" for name in current.keys() - update.state.keys()]
        problems += [f"unexpected {name}" for name in update.state.keys() - current.keys()]
        for name, tensor in update.state.items():
            if name in current and (tensor.shape != current[name].shape or tensor.dtype != current[name].dtype):
                problems.append(
                    f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {tuple(current[name].shape)} {current[name].dtype}"
                )
        if problems:
            raise WeightSyncError(
                f"weight update v{update.version} for agent {update.agent!r} does not match the replica's model "
                f"({len(problems)} problems: {'; '.join(problems[:5])}); weights left at v{self.version}"
            )
        with torch.no_grad():
            self.model.load_state_dict(update.state, strict=True)
        self.version = update.version
