"""One agent's trainer: its own weights and optimizer, one GRPO update per global batch.

The trainer knows nothing of Dask, Prefect or the store: it takes a ``TrainBatch`` and returns an
``UpdateResult``. Micro-batches run forward/backward in a fixed order and accumulate gradients; one
optimizer step and one version bump follow per global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pyarrow as pa
import torch
from accelerate import Accelerator

from flexmarl.models.loading import load_model
from flexmarl.training.config import TrainerConfig
from flexmarl.training.losses import BatchNorm, policy_loss


@dataclass(frozen=True)
class TrainBatch:
    """An agent's global batch, in a deterministic order (sorted by sample id)."""

    sample_ids: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    advantages: list[float]

    @classmethod
    def from_arrow(cls, rows: pa.Table) -> TrainBatch:
        rows = rows.sort_by("sample_id")
        return cls(
            sample_ids=rows["sample_id"].to_pylist(),
            prompt_ids=rows["prompt_ids"].to_pylist(),
            response_ids=rows["response_ids"].to_pylist(),
            logprobs=rows["logprobs"].to_pylist(),
            advantages=rows["advantage"].to_pylist(),
        )

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def slice(self, start: int, stop: int) -> TrainBatch:
        return TrainBatch(*(getattr(self, f)[start:stop] for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class UpdateResult:
    agent: str
    policy_version: int  # the version the update produced (unchanged when skipped)
    consumed_ids: list[str]
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # True when the loss was not finite: weights untouched


@cache
def shared_accelerator() -> Accelerator:
    """Accelerate keeps one state per process: every trainer of a worker shares this Accelerator."""
    return Accelerator(cpu=not torch.cuda.is_available())


def response_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each response token given its prompt, right-padded: ``(B, T)`` values and mask."""
    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    width = max(len(s) for s in seqs)
    resp_width = max(len(r) for r in batch.response_ids)
    input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    # position of the logit that predicts response token t of row i: prompt_len_i - 1 + t
    starts = torch.tensor([len(p) - 1 for p in batch.prompt_ids]).unsqueeze(1)  # (B, 1)
    positions = (starts + torch.arange(resp_width)).clamp(max=width - 1)  # (B, T)
    mask = (torch.arange(resp_width) < torch.tensor([len(r) for r in batch.response_ids]).unsqueeze(1)).float()
    targets = torch.zeros((len(seqs), resp_width), dtype=torch.long)
    for i, r in enumerate(batch.response_ids):
        targets[i, : len(r)] = torch.tensor(r)

    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits  # (B, L, V)
    picked = logits.gather(1, positions.to(device).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # (B, T, V)
    logp = torch.log_softmax(picked.float() / temperature, dim=-1)
    token_logp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return token_logp, mask.to(device)


class AgentTrainer:
    """Weights, optimizer and version clock of one agent.

    Args:
        agent: the agent's name (for messages and results).
        model_dir: a local Hugging Face directory to start from.
        config: loss and optimizer settings.
        temperature: the agent's sampling temperature (tokens are scored at the same temperature).
        version: the policy version of the weights in ``model_dir``.
    """

    def __init__(
        self, agent: str, model_dir: str | Path, config: TrainerConfig, *, temperature: float, version: int = 0
    ) -> None:
        self.agent = agent
        self.config = config
        self.temperature = temperature
        self.version = version
        self.accelerator = shared_accelerator()
        model = load_model(Path(model_dir))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def train_step(self, batch: TrainBatch) -> UpdateResult:
        """Accumulate gradients over the batch's micro-batches, then take one optimizer step."""
        if len(batch) == 0:
            raise ValueError(f"agent {self.agent!r}: empty batch for update to v{self.version + 1}")
        norm = BatchNorm(num_sequences=len(batch), num_tokens=batch.num_tokens)
        size = self.config.micro_batch_size
        total_loss, stats_sum, n_micro = 0.0, {"clipfrac": 0.0, "ratio_mean": 0.0}, 0
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), size):
            micro = batch.slice(start, start + size)
            logp, mask = response_logprobs(self.model, micro, self.temperature, self.accelerator.device)
            old = torch.zeros_like(logp)
            for i, lp in enumerate(micro.logprobs):
                old[i, : len(lp)] = torch.tensor(lp)
            loss, stats = policy_loss(
                logp,
                old,
                torch.tensor(micro.advantages, dtype=logp.dtype, device=logp.device),
                mask,
                norm=norm,
                clip_eps=self.config.clip_eps,
                loss_type=self.config.loss_type,
            )
            self.accelerator.backward(loss)
            total_loss += float(loss.detach())
            n_micro += 1
            for k, v in stats.items():
                stats_sum[k] += v
        metrics = {"loss/policy": total_loss, "micro_batches": float(n_micro)}
        metrics.update({f"policy/{k}": v / n_micro for k, v in stats_sum.items()})
        if not math.isfinite(total_loss):
            self.optimizer.zero_grad(set_to_none=True)  # a NaN update must not touch the weights
            return UpdateResult(self.agent, self.version, [], batch.num_tokens, metrics, skipped=True)
        if self.config.max_grad_norm is not None:
            grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            metrics["grad_norm"] = float(grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return UpdateResult(self.agent, self.version, list(batch.sample_ids), batch.num_tokens, metrics)

    def weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the weights, on the CPU, for a weight sync."""
        model = self.accelerator.unwrap_model(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def save(self, out_dir: str | Path) -> Path:
        """Save the weights as a Hugging Face directory (no tokenizer: the caller copies it)."""
        out = Path(out_dir)
        self.accelerator.unwrap_model(self.model).save_pretrained(out)
        return out
