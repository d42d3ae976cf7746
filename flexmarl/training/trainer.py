"""One agent's trainer: its own weights and optimizer, one GRPO update per global batch.

The trainer knows nothing of Dask, Prefect or the store. ``accumulate`` runs forward/backward on one
micro-batch and adds to the gradient; ``finish_step`` divides the gradient by the global batch's
normaliser and takes one optimizer step and one version bump. Micro-batches can thus arrive one by one while
the rest of the batch is still being generated, and the update equals the full-batch update.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import DeviceMesh
from transformers import get_scheduler, modeling_utils

from flexmarl.models.adapters import AdapterHost
from flexmarl.models.loading import CACHE_ARG, load_model
from flexmarl.models.prefix import prefill, saves_work
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import world_all_reduce
from flexmarl.training.losses import batch_normaliser, policy_loss
from flexmarl.training.sharding import full_weights, part, rank, shard_model, total_norm, zero_optimizer

log = logging.getLogger(__name__)

# transformers >= 5.20 keeps one set of logit positions per row (a (B, T) logits_to_keep); the vLLM CPU
# environment's transformers (< 5.20) takes a single 1-D index for the whole batch
_KEEPS_PER_ROW = hasattr(modeling_utils, "slice_logits_to_keep")


@dataclass(frozen=True)
class TrainBatch:
    """An agent's global batch, in a deterministic order (sorted by sample id)."""

    sample_ids: list[str]
    prompt_ids: list[list[int]]  # lists: ``prefix.prefill`` compares prompts token by token
    response_ids: list[torch.Tensor]  # int32, one per sample
    logprobs: list[torch.Tensor]  # float32 behaviour log-probs, from the rollout
    advantages: list[float]
    versions: list[int]  # policy version that generated each sample

    def __post_init__(self) -> None:
        # batches built by hand (tests, tools) may hold lists or arrays; no copy for tensors of these types
        object.__setattr__(self, "response_ids", [torch.as_tensor(r, dtype=torch.int32) for r in self.response_ids])
        object.__setattr__(self, "logprobs", [torch.as_tensor(lp, dtype=torch.float32) for lp in self.logprobs])

    @classmethod
    def from_arrow(cls, rows: pa.Table) -> TrainBatch:
        rows = rows.sort_by("sample_id")
        return cls(
            sample_ids=rows["sample_id"].to_pylist(),
            prompt_ids=rows["prompt_ids"].to_pylist(),
            response_ids=row_tensors(rows["response_ids"]),
            logprobs=row_tensors(rows["logprobs"]),
            advantages=rows["advantage"].to_pylist(),
            versions=rows["policy_version"].to_pylist(),
        )

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def slice(self, start: int, stop: int) -> TrainBatch:
        return TrainBatch(*(getattr(self, f)[start:stop] for f in self.__dataclass_fields__))


def row_tensors(column: pa.ChunkedArray) -> list[torch.Tensor]:
    """One tensor per row of an Arrow list column: views into one copy of its values, not a Python object per
    element."""
    lists = column.combine_chunks()
    values = torch.from_numpy(np.array(lists.flatten()))  # a writable copy: torch refuses read-only memory
    return list(torch.split(values, np.diff(lists.offsets.to_numpy()).tolist()))


@dataclass(frozen=True)
class UpdateResult:
    agent: str
    policy_version: int  # the version after the update (advanced even when skipped: batches are counted)
    consumed_ids: list[str]
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # True when the loss was not finite: weights untouched
    # An empty update (nothing to train: consumed_ids == [], metrics micro_batches 0) is not skipped: it had
    # nothing to skip, and it leaves the weights untouched too.

    @classmethod
    def of_ranks(cls, results: list[UpdateResult]) -> UpdateResult:
        """The update of a trainer group, from its ranks' results: each rank reports the samples it consumed,
        and the group's version, tokens and metrics (the same on every rank), except the time its all-reduce
        took. The rank that arrived last waited for no other: its time is the transfer's (``time/reduce_s``);
        the longest minus it is the wait for the slowest rank (``time/reduce_wait_s``)."""
        first = results[0]
        consumed = sorted(i for r in results for i in r.consumed_ids)
        metrics = {**first.metrics, "ranks": float(len(results)),
                   "ranks_trained": float(sum(bool(r.consumed_ids) for r in results))}
        times = [r.metrics["time/reduce_s"] for r in results if "time/reduce_s" in r.metrics]
        if times:
            metrics.update({"time/reduce_s": min(times), "time/reduce_wait_s": max(times) - min(times)})
        return cls(first.agent, first.policy_version, consumed, first.num_tokens, metrics, first.skipped)


class AcceleratorConflict(RuntimeError):
    """A second, different accelerate configuration was asked for in a process that already has one."""


_ACCELERATOR: tuple[str, Accelerator] | None = None  # (mixed_precision, the process's Accelerator)


def shared_accelerator(mixed_precision: str = "no") -> Accelerator:
    """The process's one Accelerator, built on first use from the run's ``training.mixed_precision``.

    Accelerate keeps one state per process, so every trainer of a worker shares this Accelerator, and a
    long-lived worker cannot switch configuration between runs.

    Raises:
        AcceleratorConflict: this process already trains with another ``mixed_precision``.
    """
    global _ACCELERATOR
    if _ACCELERATOR is not None:
        built, accelerator = _ACCELERATOR
        if built != mixed_precision:
            raise AcceleratorConflict(
                f"this process already trains with training.mixed_precision={built!r} and cannot switch to "
                f"{mixed_precision!r}: accelerate allows one configuration per process. Use one value per run, "
                "or restart the Dask workers (a fresh cluster) before a run with another value"
            )
        return accelerator
    _ACCELERATOR = (mixed_precision, Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision))
    return _ACCELERATOR[1]


def response_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, device: torch.device, *, share_prompts: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each response token given its prompt, right-padded: ``(B, T)`` values and mask.

    When prompts share tokens (a chat template's head; a GRPO group's whole prompt), the shared tokens run once
    and their KV cache is copied to each sample, which then runs only its own tokens (``prefix.prefill``): a
    group of 8 with a 60-token prompt and 12-token answers computes about 150 positions instead of 576.
    Gradients reach the shared tokens from every sample, as they would through copies; the result equals the
    one-sequence-per-sample path up to float rounding. ``share_prompts=False`` always takes that path: one
    forward per batch, as a sharded model's ranks must each run the same number of forwards.
    """
    if share_prompts and saves_work(batch.prompt_ids):
        picked = shared_prompt_logits(model, batch.prompt_ids, batch.response_ids, device)
    else:
        picked = full_sequence_logits(model, batch, device)
    targets, mask = padded(batch.response_ids)
    logp = torch.log_softmax(picked.float() / temperature, dim=-1)
    token_logp = logp.gather(-1, targets.long().to(device).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return token_logp, mask.to(device)


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` right-padded rows (zeros after each row's end) and the float mask of their positions."""
    values = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = (torch.arange(values.shape[1]) < torch.tensor([len(r) for r in rows]).unsqueeze(1)).float()
    return values, mask


def full_sequence_logits(model: torch.nn.Module, batch: TrainBatch, device: torch.device) -> torch.Tensor:
    """``(B, T, V)``: the logits that predict each response token, one right-padded prompt + response per row."""
    seqs = [torch.cat([torch.tensor(p, dtype=torch.int32), r])
            for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    input_ids, attention = padded(seqs)
    width, resp_width = input_ids.shape[1], max(len(r) for r in batch.response_ids)
    input_ids, attention = input_ids.long(), attention.long()
    # position of the logit that predicts response token t of row i: prompt_len_i - 1 + t
    starts = torch.tensor([len(p) - 1 for p in batch.prompt_ids]).unsqueeze(1)  # (B, 1)
    positions = (starts + torch.arange(resp_width)).clamp(max=width - 1)  # (B, T)

    # logits only where they predict a response token: the prompt's positions never reach the vocabulary
    # projection, which is a fifth of a small model's compute and its largest activation (B, L, V)
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}
    if _KEEPS_PER_ROW:
        return model(**inputs, logits_to_keep=positions.to(device)).logits  # (B, T, V)
    # one index for all rows: the union of the rows' positions, then each row's own
    keep, where = positions.unique(return_inverse=True)
    return torch.take_along_dim(model(**inputs, logits_to_keep=keep.to(device)).logits,
                                where.to(device)[..., None], dim=1)  # (B, T, V)


def shared_prompt_logits(
    model: torch.nn.Module, prompts: list[list[int]], responses: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``(B, T, V)``: the logits that predict each response token, shared prompt tokens computed once.

    The prompts run through ``prefix.prefill`` (their common head once, each distinct prompt once), whose last
    logits predict each response's first token; the responses then run right-padded on the copied KV cache,
    a response token's logits predicting the next one.
    """
    pre = prefill(model, prompts, 0, device)
    first = pre.next_logits[:, None, :]  # (B, 1, V)
    feed = max(len(r) for r in responses) - 1  # the last token of the longest response predicts nothing
    if feed <= 0:
        return first
    resp_ids = torch.zeros((len(responses), feed), dtype=torch.long)
    resp_attention = torch.zeros((len(responses), feed), dtype=torch.long)
    for i, r in enumerate(responses):
        n = max(len(r) - 1, 0)
        resp_ids[i, :n] = r[:n]
        resp_attention[i, :n] = 1
    rest = model(
        input_ids=resp_ids.to(device),
        attention_mask=torch.cat([pre.attention, resp_attention.to(device)], dim=1),
        position_ids=pre.next_position[:, None] + torch.arange(feed, device=device),
        use_cache=True,
        **{CACHE_ARG: pre.cache},
    ).logits  # (B, feed, V)
    return torch.cat([first, rest], dim=1)


class AgentTrainer:
    """Weights, optimizer (and optional lr scheduler) and version clock of one agent.

    Args:
        agent: the agent's name (for messages and results).
        model_dir: a local Hugging Face directory to start from.
        config: loss and optimizer settings.
        temperature: the agent's sampling temperature (tokens are scored at the same temperature).
        version: the policy version of the weights in ``model_dir``.
        host: where an adapter agent (``config.adapter``) adds its adapter: the base model it shares with the
            other adapter agents of its process; by default a host of its own.
        mesh: the ranks of the agent's sharded trainer group (``training.sharding``, ``group.join_world``):
            'full' shards the weights, gradients and optimizer state over them (``sharding.shard_model``),
            'optimizer' only the optimizer state (``sharding.zero_optimizer``); every rank takes part in each
            micro-batch, training its part of the samples.

    An adapter agent's "weights" are its adapter's tensors: they are what ``weights`` returns, what a state
    move carries and what the optimizer steps; the base model stays frozen.
    """

    def __init__(
        self,
        agent: str,
        model_dir: str | Path,
        config: TrainerConfig,
        *,
        temperature: float,
        max_new_tokens: int = 1,
        version: int = 0,
        host: AdapterHost | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.agent = agent
        self.config = config
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens  # the constant of the 'dr_grpo' normaliser
        self.version = version
        self.accelerator = shared_accelerator(config.mixed_precision)
        self.host, self.adapter = None, None
        self.reference = None
        self.mesh = mesh
        self.fsdp = mesh is not None and config.sharding == "full"  # else its weights are whole on every rank
        self._gathered: tuple[int, dict[str, torch.Tensor]] | None = None  # an FSDP2 trainer's: (version, weights)
        if mesh is not None and (config.adapter is not None or not config.sharded):
            raise ValueError(f"agent {agent!r}: a trainer over a mesh needs training.sharding 'optimizer' or "
                             "'full', and no adapter")
        if config.adapter is not None:
            self.host = host or AdapterHost(model_dir, self.accelerator.device)
            self.adapter = self.host.add(agent, config.adapter)
            model = self.host.model
            self.params = self.host.parameters(self.adapter)
        else:
            model = self._placed(load_model(Path(model_dir)))
            self.params = dict(model.named_parameters())
            # The KL reference is the starting weights, frozen (an extra copy in memory, only when used; an
            # adapter agent's reference is its base with the adapters off).
            if config.kl_coef > 0:
                self.reference = self._placed(load_model(Path(model_dir))).eval().requires_grad_(False)
        model.train()
        if mesh is not None and not self.fsdp:
            optimizer = zero_optimizer(list(self.params.values()), lr=config.lr, weight_decay=config.weight_decay)
        else:
            optimizer = torch.optim.AdamW(self.params.values(), lr=config.lr, weight_decay=config.weight_decay)
        # Stepped by hand once per optimizer step (not through accelerate, which steps a prepared scheduler
        # once per process); None keeps the lr constant.
        self.scheduler = None
        if config.lr_warmup_steps > 0:
            self.scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=config.lr_warmup_steps)
        if self.fsdp:  # FSDP2 places the weights and runs the mixed precision itself
            self.model, self.optimizer = model, optimizer
        elif self.mesh is not None:  # ZeRO-1: torch's optimizer steps its share and broadcasts it
            self.model, self.optimizer = self.accelerator.prepare(model), optimizer
        elif self.host is None:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        else:  # the host's model is shared (and on the device already): only this agent's optimizer is prepared
            self.model, self.optimizer = model, self.accelerator.prepare(optimizer)

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.fsdp:
            return model.to(self.accelerator.device)
        return shard_model(model.to(self.accelerator.device), self.mesh, self.config.mixed_precision)

    @property
    def ranks(self) -> int:
        """How many ranks the state is sharded over (1: not sharded)."""
        return self.mesh.size() if self.mesh is not None else 1

    @contextmanager
    def _in_use(self) -> Iterator[torch.nn.Module]:
        """The model with this agent's weights in use: the trainer's own, or the host's with its adapter active
        (under the accelerator's autocast, which a prepared model has built in)."""
        if self.host is None:
            yield self.model
            return
        with self.host.active(self.adapter) as model, self.accelerator.autocast():
            yield model

    @contextmanager
    def _reference(self) -> Iterator[torch.nn.Module | None]:
        if self.host is None or self.config.kl_coef == 0:
            yield self.reference
            return
        with self.host.without_adapters() as model, self.accelerator.autocast():
            yield model

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        # Gradients add up in float64, so that the sum does not depend on the order in which
        # micro-batches arrive (pipelined and synchronous schedules then give the same weights).
        self._grad_sum = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in self.params.items()}
        self._consumed: list[str] = []
        self._responses = self._tokens = 0
        self._loss_sum = 0.0
        self._stats: dict[str, float] = defaultdict(float)
        self._micro = 0  # micro-batches trained
        self._parts = 0  # of them, the parts this rank trained (a sharded trainer's rank trains part of each)
        self._is_sum = self._is_at_cap = 0.0  # importance weights summed, and tokens at the cap

    @property
    def step_under_way(self) -> bool:
        """Micro-batches are accumulated for the next update (a gradient sum exists outside the state)."""
        return hasattr(self, "_consumed")

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward on one micro-batch at the current weights; adds to the step's gradient."""
        if not hasattr(self, "_consumed"):
            self.begin_step()
        if len(batch) == 0:
            return {}
        device = self.accelerator.device
        if self.mesh is not None:
            start, stop = part(len(batch), self.mesh.get_local_rank(), self.ranks)
            self._micro += start == 0  # counted once over the ranks: by the one with its first sample
            if start == stop:  # fewer samples than ranks: an FSDP2 rank still takes part in the collectives
                if self.fsdp:
                    self._idle_pass(batch.slice(0, 1), device)
                return {}
            batch = batch.slice(start, stop)
        else:
            self._micro += 1
        with self._in_use() as model:
            return self._accumulate(model, batch, device)

    def _idle_pass(self, batch: TrainBatch, device: torch.device) -> None:
        """A forward and backward that adds nothing (a zero loss), run by a rank of a sharded trainer that has no
        sample of the micro-batch: each rank must gather and reduce every layer as often as the others."""
        logp, _ = response_logprobs(self.model, batch, self.temperature, device, share_prompts=False)
        if self.reference is not None:
            with torch.no_grad():
                response_logprobs(self.reference, batch, self.temperature, device, share_prompts=False)
        (logp.sum() * 0.0).backward()
        for name, p in self.params.items():
            if p.grad is not None:
                self._grad_sum[name] += p.grad
        self.optimizer.zero_grad(set_to_none=True)

    def _accumulate(self, model: torch.nn.Module, batch: TrainBatch, device: torch.device) -> dict[str, float]:
        shared = not self.fsdp  # the shared-prefix prefill's forwards depend on the prompts: not under FSDP2
        logp, mask = response_logprobs(model, batch, self.temperature, device, share_prompts=shared)  # (B, T)
        behaviour = padded(batch.logprobs)[0].to(device)  # (B, T), zeros past each response
        # Decoupled PPO for every sample: clip against the current weights (the proximal policy: one
        # optimizer step per global batch, so these are the weights before it) and correct from the policy
        # that generated the sample with capped importance weights current/behaviour. A stale sample's weight
        # corrects its older version; a fresh one's is 1 up to the rollout engine's numerics, and capping it
        # keeps a bf16 engine/trainer mismatch from clipping (or blowing up) its gradient.
        old = logp.detach()
        to_behaviour = torch.exp(logp.detach() - behaviour)  # (B, T)
        is_weights = to_behaviour.clamp(max=self.config.is_cap)
        stale = torch.tensor([v < self.version for v in batch.versions], device=device)  # (B,)
        ref_logp = None
        with self._reference() as reference:
            if reference is not None:
                with torch.no_grad():
                    ref_logp, _ = response_logprobs(reference, batch, self.temperature, device, share_prompts=shared)
        loss, stats = policy_loss(
            logp, old, torch.tensor(batch.advantages, dtype=logp.dtype, device=device), mask,
            clip_eps=self.config.clip_eps, clip_eps_high=self.config.clip_eps_high,
            loss_type=self.config.loss_type, is_weights=is_weights, ref_logprobs=ref_logp, kl_coef=self.config.kl_coef,
        )
        self.accelerator.backward(loss)
        for name, p in self.params.items():
            if p.grad is not None:
                self._grad_sum[name] += p.grad
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_sum += float(loss.detach())
        self._consumed += batch.sample_ids
        self._responses += len(batch)
        self._tokens += batch.num_tokens
        self._parts += 1
        with torch.no_grad():  # token-weighted over the whole update (unlike the per-micro-batch means)
            self._is_sum += float((is_weights * mask).sum())
            self._is_at_cap += float(((to_behaviour >= self.config.is_cap).float() * mask).sum())
        stats["stale_fraction"] = float(stale.float().mean())
        for k, v in stats.items():
            self._stats[k] += v
        return stats

    def finish_step(self, reduce: Callable[[list[torch.Tensor]], None] | None = None) -> UpdateResult:
        """Divide the accumulated gradient by the global batch's normaliser; one optimizer step.

        A step with nothing accumulated (every sample of the global batch failed, or was dropped by
        ``dynamic_sampling``) is an empty update: the version advances, since versions count global
        batches, and the weights, the optimizer and the lr schedule stay untouched; it consumes nothing.

        ``reduce``: when the step was spread over the ranks of the agent's trainer group, the group's in-place
        sum over ranks (``group.all_reduce``); a sharded trainer's is always its world's (``world_all_reduce``).
        Every rank calls this, with whatever it trained (nothing included); the gradient sums and the loss
        counters are summed first, so every rank takes the same step on the global batch. The result's
        ``consumed_ids`` are this rank's; the rest is the group's.
        """
        if self.mesh is not None:
            reduce = world_all_reduce
        reduced = {}
        if reduce is not None:
            if not self.step_under_way:
                self.begin_step()  # a rank that trained nothing still adds its zeros
            start = time.perf_counter()
            self._sum_over_ranks(reduce)
            reduced = {"time/reduce_s": time.perf_counter() - start}  # with the wait for the last rank to arrive
        if not self.step_under_way or self._responses == 0:
            for name in ("_grad_sum", "_consumed"):  # begun by an empty micro-batch, or not at all
                self.__dict__.pop(name, None)
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            return UpdateResult(self.agent, self.version, [], 0, {"micro_batches": 0.0, **reduced})
        norm = batch_normaliser(
            self.config.loss_type, responses=self._responses, tokens=self._tokens, max_len=self.max_new_tokens
        )
        for name, p in self.params.items():
            p.grad = (self._grad_sum[name] / norm).to(p.dtype)
        del self._grad_sum
        metrics = {"loss/policy": self._loss_sum / norm, "loss/normaliser": float(norm),
                   "micro_batches": float(self._micro), **reduced}
        metrics.update({f"policy/{k}": v / self._parts for k, v in self._stats.items()})
        metrics["policy/is_weight_mean"] = self._is_sum / max(self._tokens, 1)
        metrics["policy/is_weight_at_cap"] = self._is_at_cap / max(self._tokens, 1)
        consumed, tokens = self._consumed, self._tokens
        del self._consumed
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        grad_norm = total_norm(grads) if grads else 0.0
        metrics["grad_norm"] = grad_norm
        if not (math.isfinite(metrics["loss/policy"]) and math.isfinite(grad_norm)):
            # A NaN update must not touch the weights. The version still advances, so that versions keep
            # counting global batches: the batch is spent, and the skip is reported.
            log.warning(
                "agent %r: the update to v%d is skipped, weights untouched: loss %s, gradient norm %s are not "
                "finite; lower training.lr, or check the rewards and advantages of this batch",
                self.agent, self.version + 1, metrics["loss/policy"], grad_norm,
            )
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            return UpdateResult(self.agent, self.version, [], tokens, metrics, skipped=True)
        if self.config.max_grad_norm is not None:
            self.accelerator.clip_grad_norm_(list(self.params.values()), self.config.max_grad_norm)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return UpdateResult(self.agent, self.version, consumed, tokens, metrics)

    def _stat_keys(self) -> tuple[str, ...]:
        """The per-micro-batch statistics ``policy_loss`` and ``_accumulate`` report, in a fixed order."""
        return ("clipfrac", "ratio_mean", "stale_fraction", *(("kl",) if self.config.kl_coef > 0 else ()))

    def _sum_over_ranks(self, reduce: Callable[[list[torch.Tensor]], None]) -> None:
        """Make this step's gradient sum and counters the group's: the sums over every rank's. An FSDP2 trainer's
        gradient sum is the group's already (each backward reduce-scattered it): only its counters are summed."""
        keys = self._stat_keys()
        sums = [] if self.fsdp else list(self._grad_sum.values())
        counters = torch.tensor(
            [self._responses, self._tokens, self._loss_sum, self._micro, self._parts, self._is_sum, self._is_at_cap,
             *(self._stats.get(k, 0.0) for k in keys)], dtype=torch.float64, device=self.accelerator.device)
        reduce([*sums, counters])
        values = counters.tolist()
        self._responses, self._tokens, self._micro, self._parts = (int(v) for v in values[:2] + values[3:5])
        self._loss_sum, self._is_sum, self._is_at_cap = values[2], values[5], values[6]
        self._stats = defaultdict(float, zip(keys, values[7:], strict=True))

    def train_step(self, batch: TrainBatch) -> UpdateResult:
        """A whole global batch at once: micro-batches of ``micro_batch_size`` in order, then one step."""
        if len(batch) == 0:
            raise ValueError(f"agent {self.agent!r}: empty batch for update to v{self.version + 1}")
        self.begin_step()
        for start in range(0, len(batch), self.config.micro_batch_size):
            self.accumulate(batch.slice(start, start + self.config.micro_batch_size))
        return self.finish_step()

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The tensors that make this agent's policy (live, not copies): the model's state dict, or the
        adapter's tensors."""
        if self.host is not None:
            return self.host.state(self.adapter)
        return self.accelerator.unwrap_model(self.model).state_dict()

    def load_policy_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (as ``policy_state`` names them) into this agent's weights, onto its device."""
        if self.host is not None:
            self.host.load_state(self.adapter, tensors)
        else:
            self.accelerator.unwrap_model(self.model).load_state_dict(tensors)

    def weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the weights (an adapter agent: its adapter's), on the CPU, for a weight sync.

        An FSDP2 trainer's are gathered whole onto rank 0 (the other ranks get an empty dict) once per version,
        then kept until its weights change (``gathered_weights``): every rank must call this at once, so that all
        gather or none does (a version names its weights: a step that changes them advances it)."""
        if self.fsdp:
            if self._gathered is None or self._gathered[0] != self.version:
                self._gathered = (self.version, full_weights(self.model))
            return self._gathered[1]
        if self.mesh is not None and rank() != 0:  # ZeRO-1: whole on every rank already, and rank 0's suffice
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy_state().items()}

    def weights_in_place(self) -> dict[str, torch.Tensor]:
        """The weights where they are, not copied (an FSDP2 trainer's as its ranks gathered them), for a rollout
        engine on this worker to copy into its own: a weight sync that never leaves the device. They change with
        the next optimizer step."""
        if self.fsdp:
            return self.gathered_weights()
        return {k: v.detach() for k, v in self.policy_state().items()}

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """An FSDP2 trainer's whole weights as its ranks last gathered them (``weights``), on rank 0; one rank
        alone cannot gather them, so weights of an older version are refused."""
        if self._gathered is None or self._gathered[0] != self.version:
            raise RuntimeError(f"agent {self.agent!r}: the whole weights of v{self.version} were not gathered; "
                               "every rank of its group gathers them at once (weights())")
        return self._gathered[1]

    def close(self) -> None:
        """Let go of the model and optimizer: the shared Accelerator keeps every object it prepared, so a
        trainer dropped from a worker (its agent moved away, or the run ended) would otherwise stay in memory."""
        # Accelerate can only forget all it prepared (free_memory), not one trainer's objects. Forgetting the
        # worker's other trainers' is harmless: on one device, what they call (backward, clip_grad_norm_,
        # autocast, unwrap_model) never reads those lists; only save_state/load_state, fp16 loss scaling and
        # FSDP/DeepSpeed/XLA do, and FlexMARL uses none of them.
        self.accelerator.free_memory()
        self._gathered = None
        if self.host is not None:
            self.host.remove(self.adapter)

    def save(self, out_dir: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
        """Save the weights as a Hugging Face directory, or an adapter agent's adapter in peft's format (no
        tokenizer: the caller copies it). A sharded trainer saves the whole ``weights`` it is given (gathered by
        ``weights()`` on rank 0)."""
        out = Path(out_dir)
        if self.host is not None:
            return self.host.save(self.adapter, out)
        if self.mesh is not None:
            if weights is None:
                raise ValueError(f"agent {self.agent!r}: a sharded trainer saves the whole weights it is given")
            self.model.save_pretrained(out, state_dict=weights)
            return out
        self.accelerator.unwrap_model(self.model).save_pretrained(out)
        return out
