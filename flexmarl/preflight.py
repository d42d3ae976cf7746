"""What can be checked before a run starts anything: ``flexmarl validate`` and a run's plan
(``flexmarl/run/plan.py``, for ``flexmarl train`` and the training flow) run the same code.

Config validation (``load_config``) sees only the config. These checks read what it names, without writing
anything: each model's files (a GGUF or safetensors header that does not parse, a tokenizer larger than its
model), the data (a reasoning-gym dataset and its arguments, every line of a JSONL file and its final answer,
HumanEval), and whether the run directory and a local store could be created. A run that passes them
should fail later only for reasons no check could see (a worker dies, a disk fills up).

Example:
    >>> cfg = load_config(preset="tiny")
    >>> check_inputs(cfg)          # raises ModelError or DataError naming the problem and the fix
    >>> check_run_location(cfg, "runs/new")
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dask.utils import format_bytes

from flexmarl.cluster.worker_python import check_worker_python
from flexmarl.config import ConfigError, RunConfig
from flexmarl.models.adapters import check_adapter_targets
from flexmarl.models.loading import BUILTIN_MODELS, ModelError, check_model_dir, meta_model, resolve_model
from flexmarl.run.layout import store_uri
from flexmarl.workloads.datasets import load_problems

GGUF_MAGIC = b"GGUF"


class RunLocationError(RuntimeError):
    """The run directory or the store could not be created or written; the message names the path and the fix."""


def check_inputs(cfg: RunConfig) -> None:
    """Every model and the data the config names can be read, and each full-model agent's training state fits a
    worker (``check_training_memory``). Builds or converts each model once (cached).

    Raises:
        ModelError: a model file whose header does not parse, or a tokenizer that does not fit its model
            (the agent named).
        DataError: an unknown dataset or argument (valid ones listed), a JSONL line that does not parse or whose
            answer has no final number (file and line named), an empty file.
        WorkerPythonError: a ``cluster.worker_python`` that cannot run the workers (or lacks vLLM, where the
            rollout needs it).
        ConfigError: an agent's training state over a worker's memory limit.
    """
    for name, agent in cfg.agents.items():
        try:
            check_model_files(agent.model)
            check_model_dir(resolve_model(agent.model, seed=cfg.run.seed))
        except ModelError as exc:
            raise ModelError(f"agents.{name}.model: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a damaged model directory
            raise ModelError(
                f"agents.{name}.model: {agent.model!r} cannot be read as a model ({type(exc).__name__}: "
                f"{_first_line(exc)}); give a Hugging Face model directory written by save_pretrained, or a .gguf file"
            ) from None
        if agent.adapter is not None:
            try:
                check_adapter_targets(resolve_model(agent.model, seed=cfg.run.seed), agent.adapter)
            except ModelError as exc:
                raise ModelError(f"agents.{name}.{exc}") from None
    load_problems(cfg.data)
    check_worker_python(cfg.cluster, needs_vllm=cfg.rollout.backend == "vllm")
    check_training_memory(cfg)


@dataclass(frozen=True)
class RankState:
    """What one rank of a full-model trainer holds at its optimizer step, in bytes per parameter."""

    whole: int  # held whole by every rank
    divided: int  # divided over the ranks
    what: str  # the same, in words, for the error


BYTES_PER_PARAMETER = {
    "none": RankState(4 + 4 + 8 + 8, 0, "float32 weights and gradient, two AdamW moments, the float64 gradient sum"),
    "optimizer": RankState(4 + 4 + 8, 8, "float32 weights and gradient and the float64 gradient sum on every rank, "
                                         "the two AdamW moments divided over the ranks"),
    "full": RankState(4, 4 + 4 + 8 + 8, "the whole float32 weights each rank loads and its home keeps, and its "
                                        "share of the weights, gradient, two AdamW moments and float64 gradient sum"),
}
"""A rank's state by ``training.sharding``: float32 weights and gradient, the two AdamW moments, and the float64
gradient sum the micro-batches add into (``AgentTrainer.begin_step``). ZeRO-1 divides the moments; FSDP2
divides all of it, but each rank loads the whole weights before sharding them, and the home keeps them
gathered for the weight syncs."""


def training_state_bytes(model_dir: Path, *, kl: bool, sharding: str = "none", ranks: int = 1) -> int:
    """What one rank of a full-model trainer of ``model_dir`` holds at its optimizer step, activations left out
    (a lower bound; ``BYTES_PER_PARAMETER``): one trainer, or one of ``ranks`` sharded as ``sharding`` says.
    ``kl``: with the frozen reference copy that a KL penalty reads (sharded only by FSDP2)."""
    unique = {id(p): p for p in meta_model(model_dir).parameters()}.values()
    params = sum(p.numel() for p in unique)
    held = BYTES_PER_PARAMETER[sharding]
    whole, divided = held.whole, held.divided
    if kl:
        whole, divided = (whole, divided + 4) if sharding == "full" else (whole + 4, divided)
    return params * whole + -(-params * divided // ranks)


def check_training_memory(cfg: RunConfig) -> None:
    """Each full-model agent's training state fits a LocalCluster worker's memory limit (checked against the
    lower bound ``training_state_bytes``, per rank for a sharded agent; a cluster at ``cluster.address`` is not
    checked here).

    Raises:
        ConfigError: naming the agent, both sizes and the fixes.
    """
    limit = cfg.cluster.worker_memory_bytes()
    if limit is None:
        return
    shares: dict[str, int] = {}  # sharded agents: each rank's share (they share their ranks, and never move)
    for name, agent in cfg.agents.items():
        if agent.adapter is not None:  # an adapter's state is a small part of its model's
            continue
        trainer = cfg.trainer_config(name)
        kl = trainer.kl_coef > 0
        ranks = trainer.max_slots if trainer.sharded else 1
        need = training_state_bytes(resolve_model(agent.model, seed=cfg.run.seed), kl=kl, sharding=trainer.sharding,
                                    ranks=ranks)
        if trainer.sharded:
            shares[name] = need
        if need <= limit:
            continue
        rank_state = BYTES_PER_PARAMETER[trainer.sharding]
        per = f"{rank_state.whole} bytes per parameter" + (
            f" and {rank_state.divided} over the ranks" if trainer.sharded else "")
        held = f"{per}{' + 4 for the KL reference' if kl else ''}: {rank_state.what}"
        what = f"its training state needs at least {format_bytes(need)} ({held})"
        fix = (f"or shard it over several slots (agents.{name}.training.sharding: 'full', or 'optimizer' for the "
               "AdamW moments only, with training.max_slots: the number of slots; a data-parallel trainer group "
               "holds the whole state on every rank)")
        if trainer.sharded:
            what = (f"its training state, sharded ({trainer.sharding!r}) over {ranks} ranks, needs at least "
                    f"{format_bytes(need)} on each ({held})")
            fix = ("or shard it over more slots (training.max_slots)" if trainer.sharding == "full" else
                   "or shard it over more slots (training.max_slots), or all of it (training.sharding: 'full')")
        raise ConfigError(
            f"agents.{name}: {what} but a worker's memory limit is {format_bytes(limit)} "
            f"(cluster.memory_limit={cfg.cluster.memory_limit!r} over {cfg.cluster.n_workers} workers): raise "
            f"cluster.memory_limit or use fewer workers, pick a smaller model, train the agent as a LoRA adapter "
            f"(agents.{name}.adapter), {fix}"
        )
    if len(shares) > 1 and sum(shares.values()) > limit:
        each = ", ".join(f"{a} {format_bytes(n)}" for a, n in shares.items())
        raise ConfigError(
            f"agents {', '.join(shares)}: sharded over the same ranks, their shares add up to at least "
            f"{format_bytes(sum(shares.values()))} on each rank ({each}) but a worker's memory limit is "
            f"{format_bytes(limit)} (cluster.memory_limit={cfg.cluster.memory_limit!r} over {cfg.cluster.n_workers} "
            "workers): raise cluster.memory_limit, shard them over more slots (training.max_slots), or shard fewer "
            "of them (agents.<name>.training.sharding: 'none')"
        )


def check_model_files(model: str) -> None:
    """A .gguf file starts with the GGUF magic, and every safetensors file of a model directory has a header
    that parses: a copied or truncated file fails here, not deep inside transformers once the cluster runs."""
    if model in BUILTIN_MODELS:
        return
    path = Path(model).expanduser()
    if path.is_file():
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(
                f"model file {model!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); give a "
                "complete .gguf file (llama.cpp's format) or a Hugging Face model directory"
            )
        return
    from safetensors import safe_open  # reads the header only

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type, and OSError
            raise ModelError(
                f"model weights {weights} do not parse as safetensors ({_first_line(exc)}): the file is damaged "
                "or incomplete; copy it again, or write the model again with save_pretrained"
            ) from None


def check_run_location(cfg: RunConfig, run_dir: str | Path) -> str:
    """The run directory and a local store can be created and written, checked without creating either.
    Returns the store's URI.

    Raises:
        RunLocationError: a file in the way, no permission, a read-only disk (path and fix named).
    """
    check_run_dir(run_dir)
    return check_store_location(cfg, run_dir)


def check_run_dir(run_dir: str | Path) -> None:
    """The run directory can be created and written (``RunLocationError`` if not)."""
    _check_creatable(Path(run_dir).resolve(), "the run directory", "choose another --run-dir")


def check_store_location(cfg: RunConfig, run_dir: str | Path) -> str:
    """A local store can be created and written (``RunLocationError`` if not); returns the store's URI. An
    object store's URI is taken as it is: only writing to it can tell."""
    uri = store_uri(cfg.store.uri, run_dir)
    if "://" not in uri or uri.startswith("file://"):
        _check_creatable(Path(uri.removeprefix("file://")).resolve(), "the store",
                         "set store.uri to a writable directory (or leave it null: RUN_DIR/store)")
    return uri


def _check_creatable(path: Path, what: str, fix: str) -> None:
    """``path`` is a writable directory, or could be made one: its nearest existing ancestor is a writable
    directory. Only a probe file is written (and removed), in a directory that exists already."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, os.strerror(20))
        with tempfile.TemporaryFile(dir=existing, prefix=".flexmarl-write-check-"):
            pass
    except OSError as exc:
        raise RunLocationError(f"cannot write {what} {path}: {exc.strerror or exc}; {fix}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
