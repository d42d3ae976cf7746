"""A trainer's state sharded over its group (``training.sharding``): FSDP2 or ZeRO-1 over the ranks' world,
and the distributed checkpoint (DCP) files that park it and let it resume over another number of ranks.

``full``: each rank holds 1/k of every parameter, of its gradient and of its two AdamW moments (FSDP2
``fully_shard``, one unit per decoder layer and one for the rest). A forward gathers a layer's whole weights
for as long as the layer runs; a backward reduce-scatters the layer's gradient, a sum over the ranks, so each
rank keeps the sum's own shard.

``optimizer`` (ZeRO-1): each rank holds the whole weights and gradient, and the AdamW moments of the
parameters it owns (torch's ``ZeroRedundancyOptimizer``: whole tensors, balanced by size). The gradient sums
are all-reduced once per step; each rank steps the parameters it owns and broadcasts them to the others.

Either way a micro-batch is trained by every rank at once, each on its part of the samples (``part``); losses
are sums, so the parts add up to the micro-batch's gradient.

A parked sharded state is a DCP directory (one file per rank, a ``.metadata`` index) beside the state's JSON
file (agent, version, scheduler, RNG, ranks, sharding), written last by rank 0. DCP reads any number of ranks'
files into any other number of ranks' shards: a state saved at k = 2 resumes at k = 1 and the reverse.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

SHARDS = "shards"  # the DCP directory of a sharded state, beside its JSON file
INDEX = ".metadata"  # DCP's index of the shards, written once every rank's file is


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: str) -> torch.nn.Module:
    """Shard ``model`` in place over ``mesh``: one FSDP unit per block transformers keeps whole
    (``_no_split_modules``: a decoder layer), then the root (embeddings, final norm, head).

    Gradients are reduce-scattered as plain sums (divide factor 1, sum-only collectives: gloo has no
    pre-multiplied sum), since the trainer divides the step's gradient by the global batch's normaliser itself.
    ``bf16`` runs the forward and backward in bfloat16 and keeps the weights, their gradients and the reduction
    in float32 (FSDP2's ``MixedPrecisionPolicy``, in place of accelerate's autocast).
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def zero_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> ZeroRedundancyOptimizer:
    """AdamW with its moments divided over the world's ranks (ZeRO-1): each rank steps the parameters it owns,
    then every rank broadcasts those to the others, so all end each step with the same weights."""
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr, weight_decay=weight_decay)


def part(size: int, rank: int, ranks: int) -> tuple[int, int]:
    """The ``[start, stop)`` of a micro-batch of ``size`` samples that ``rank`` of ``ranks`` trains: contiguous
    near-equal parts in rank order (empty for the last ranks when there are fewer samples than ranks)."""
    per, extra = divmod(size, ranks)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def local_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (its shards of sharded ones)."""
    return sum(_local(t).numel() * t.element_size() for t in tensors.values())


def held_bytes(weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of ``weights`` and of the optimizer's tensors (its shards of sharded ones)."""
    moments = {f"{i}.{k}": v for i, per_param in enumerate(_owned(optimizer).state.values())
               for k, v in per_param.items() if torch.is_tensor(v)}
    return local_bytes(weights) + local_bytes(moments)


def total_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm over every element of ``tensors``, whole: over all ranks' shards of sharded ones."""
    norm = torch.nn.utils.get_total_norm(tensors)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of an FSDP2 model on the CPU, on rank 0 (an empty dict on the others); every rank must
    call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole weights and AdamW moments on the CPU, flat (``weights.<name>``, ``optim.<name>.<moment>``), on
    rank 0 (an empty dict on the others); every rank must call it. For comparing states, not for moving them."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        if rank() != 0:
            return {}
        names = [name for name, _ in model.named_parameters()]  # the order the optimizer was given them in
        flat = {f"weights.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for index, per_param in optimizer.state_dict()["state"].items():
            flat.update({f"optim.{names[index]}.{k}": torch.as_tensor(v) for k, v in per_param.items()})
        return flat
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    moments = get_optimizer_state_dict(model, optimizer, options=options)
    if not weights:
        return {}
    flat = {f"weights.{k}": v for k, v in weights.items()}
    for name, per_param in moments["state"].items():
        flat.update({f"optim.{name}.{k}": torch.as_tensor(v) for k, v in per_param.items()})
    return flat


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write this rank's shards of the weights and the optimizer's state to the DCP directory ``path``; every
    rank calls it, and it returns once the index is written."""
    dcp.save(_state_dict(model, optimizer), checkpoint_id=path)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Read the DCP directory ``path`` into this rank's shards, whatever the number of ranks that wrote it."""
    state = _state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # the tensors were read in place; the settings were not
        for group, settings in zip(optimizer.param_groups, state["optim"]["param_groups"], strict=True):
            group.update(settings)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the state, as DCP writes and reads it: FSDP2's sharded state dicts; or, under ZeRO-1,
    the whole weights (every rank's the same: DCP writes them once) and the moments of the parameters this
    rank owns, named as FSDP2 names them. A parameter not stepped yet gets zero moments at step 0, which AdamW
    treats as it treats no state."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        weights, moments = get_state_dict(model, optimizer)
        return {"model": weights, "optim": moments}
    names = {p: name for name, p in model.named_parameters()}
    owned = _owned(optimizer)
    state = {}
    for p in (p for group in owned.param_groups for p in group["params"]):
        if not owned.state.get(p):
            owned.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
        state[names[p]] = owned.state[p]
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"model": model.state_dict(), "optim": {"state": state, "param_groups": settings}}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _owned(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer of this rank's parameters: a ZeRO-1 optimizer's AdamW of those it owns, or ``optimizer``."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
