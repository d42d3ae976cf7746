"""An agent's whole training state, and the one API that moves it: ``TrainingState.to(location)``.

The state is the weights (an adapter agent's: its adapter's tensors only), the AdamW moments and step counts,
the lr scheduler's position, the policy version and the RNG state. It sits at exactly one location at a time:

- ``"device"``: live in a trainer, on its accelerator (on a CPU-only worker, in the trainer's memory);
- ``"host"``: in host memory, either in a trainer whose tensors were moved off the accelerator, or as a
  detached copy that no trainer holds yet (a prefetch, waiting for a trainer to resume it);
- a directory or an fsspec URI (``runs/x/state/solver``, ``file:///shared/state/solver``,
  ``s3://bucket/prefix/solver``, ``memory://state/solver``): two safetensors files and one JSON file,
  never pickle. The JSON file is written last, so a state whose write did not finish is never read.
  A sharded trainer's state (``training.sharding``: 'optimizer' or 'full') is a distributed checkpoint instead,
  one file per rank (``sharding.py``), in a local directory; it resumes over any number of ranks.

Any trainer built from the same model and settings, on any worker, can take the state from any location,
and a round trip is bit-exact. On a GPU, host copies sit in pinned memory (about 55 GB/s on an H200
against 7-16 GB/s through pageable memory), taken from the worker's ``HOST_POOL``: pinning a fresh buffer costs
more than the copy (moves through fresh buffers ran at 1.2 GB/s on an H200), so each size is pinned once.

Example:
    >>> state = TrainingState.of(trainer)               # live on the trainer's device
    >>> state.to("host")                                # off the accelerator, still in that trainer
    >>> state.to("s3://bucket/run/state/solver", storage_options={"anon": "false"})   # parked
    >>> TrainingState.at("solver", "s3://bucket/run/state/solver").to("device", trainer=other)
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as load_tensors, load_file, save as save_tensors, save_file

from flexmarl.training import sharding

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.safetensors"
META = "state.json"  # written last: its presence marks a complete state
FORMAT = 1
DEVICE, HOST = "device", "host"


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors hold: what a weight sync of ``trainer.weights()`` sends, or a state move carries."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HostPool:
    """Host buffers for state moves, reused: a buffer given back is taken again by the next tensor of its dtype
    and size, so a worker pins each size once (the pool grows to the most it ever held at once).

    Args:
        pin: page-lock the buffers (on a GPU machine: copies from and to the device then run at the link's speed).
        keep: keep buffers given back for reuse; without, ``give`` lets them go (a CPU-only worker: pageable
            memory costs nothing to allocate, and kept buffers would only add to its resident memory).
    """

    def __init__(self, *, pin: bool, keep: bool) -> None:
        self.pin, self.keep = pin, keep
        self._lock = threading.Lock()  # a snapshot's writer thread gives buffers back beside the task thread
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        # where taken buffers start; no reference, so that a buffer dropped without ``give`` is freed, not kept
        self._taken: set[int] = set()
        self.allocated_bytes = 0  # bytes this pool has allocated (pinned), ever

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous host tensor of ``like``'s shape and dtype."""
        with self._lock:
            free = self._free[like.dtype, like.numel()]
            flat = free.pop() if free else None
        if flat is None:
            flat = torch.empty(like.numel(), dtype=like.dtype, pin_memory=self.pin)
            self.allocated_bytes += flat.numel() * flat.element_size()
        if self.keep:
            with self._lock:
                self._taken.add(flat.data_ptr())
        return flat.view(like.shape)

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take back tensors that ``take`` made, once nothing reads them (after the copies out of them landed);
        others are left alone."""
        if not self.keep:
            return
        with self._lock:
            for t in tensors:
                if t.data_ptr() in self._taken and t.is_contiguous():
                    self._taken.discard(t.data_ptr())
                    self._free[t.dtype, t.numel()].append(t.view(-1))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


HOST_POOL = HostPool(pin=torch.cuda.is_available(), keep=torch.cuda.is_available())
"""This process's (a Dask worker's: a slot's) pool of host buffers for state moves."""


@dataclass
class HostCopy:
    """A detached copy of one agent's training state in host memory (pinned on a GPU machine)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]  # "<param index>.<name>" -> tensor (Adam moments, step counts)
    meta: dict  # agent, version, optimizer param groups and scalars, scheduler state, RNG

    @property
    def agent(self) -> str:
        return self.meta["agent"]

    @property
    def version(self) -> int:
        return self.meta["version"]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (weights and optimizer state)."""
        return tensor_bytes(self.weights) + tensor_bytes(self.optimizer)

    @classmethod
    def capture(cls, trainer, *, during_step: bool = False) -> HostCopy:
        """Copy ``trainer``'s state to host memory; the trainer keeps its own.

        ``during_step``: the trainer is in the middle of an update and keeps it; the copy holds the state of the
        update's start (weights and optimizer change only at ``finish_step``), for a rank joining its group.
        """
        if trainer.step_under_way and not during_step:
            raise RuntimeError(
                f"agent {trainer.agent!r} is in the middle of the update to v{trainer.version + 1}: its gradient "
                "sum is not part of the state; move the state after finish_step"
            )
        # each name gets its own copy: safetensors refuses tensors that share memory (tied embeddings)
        weights = {k: _host(v.detach()) for k, v in trainer.policy_state().items()}
        opt = trainer.optimizer.state_dict()
        tensors, scalars = {}, {}
        for index, per_param in opt["state"].items():
            for name, value in per_param.items():
                if torch.is_tensor(value):
                    tensors[f"{index}.{name}"] = _host(value)
                else:
                    scalars[f"{index}.{name}"] = value
        rng = {"cpu": torch.get_rng_state().tolist()}
        if torch.cuda.is_available():
            rng["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        meta = {  # as JSON gives it back (tuples become lists), so that a copy looks the same from any location
            "format": FORMAT, "agent": trainer.agent, "version": trainer.version,
            "param_groups": opt["param_groups"], "scalars": scalars,
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None, "rng": rng,
        }
        return cls(weights, tensors, json.loads(json.dumps(meta)))

    def apply(self, trainer) -> None:
        """Make this the state of ``trainer`` (onto its device); the copy must not be reused afterwards.

        Raises:
            ValueError: the state belongs to another agent, or one side has an lr scheduler and the other
                not (a different ``training.lr_warmup_steps``).
        """
        if self.agent != trainer.agent:
            raise ValueError(f"the state belongs to agent {self.agent!r}, not {trainer.agent!r}")
        if (self.meta["scheduler"] is None) != (trainer.scheduler is None):
            has = "has" if self.meta["scheduler"] is not None else "has no"
            raise ValueError(
                f"the state of {self.agent!r} {has} lr scheduler and the trainer the opposite: build the trainer "
                "with the same training.lr_warmup_steps"
            )
        if trainer.step_under_way:
            raise RuntimeError(f"agent {trainer.agent!r} is in the middle of an update: cannot replace its state")
        trainer.load_policy_state(self.weights)  # copies onto the device
        state: dict[int, dict] = {}
        for key, value in self.optimizer.items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value  # load_state_dict moves them to the params' device
        for key, value in self.meta["scalars"].items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value
        # JSON turned tuples (AdamW's betas) into lists: give them back the trainer's own types
        groups = [{k: tuple(v) if isinstance(own.get(k), tuple) else v for k, v in saved.items()}
                  for saved, own in zip(self.meta["param_groups"], trainer.optimizer.param_groups, strict=True)]
        trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if trainer.scheduler is not None:
            trainer.scheduler.load_state_dict(self.meta["scheduler"])
        trainer.version = self.version
        torch.set_rng_state(torch.tensor(self.meta["rng"]["cpu"], dtype=torch.uint8))
        if torch.cuda.is_available() and "cuda" in self.meta["rng"]:
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in self.meta["rng"]["cuda"]])
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must land before the pinned buffers go back to the pool
        # what the trainer took by reference stays its own: a load onto host memory of the same dtype keeps the
        # tensor it is given (and AdamW keeps its step counts as given)
        kept = {t.data_ptr() for t in trainer.params.values()} | {
            v.data_ptr() for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
        HOST_POOL.give(t for t in [*self.weights.values(), *self.optimizer.values()] if t.data_ptr() not in kept)
        self.weights, self.optimizer = {}, {}  # the buffers may be the pool's again: a reuse fails, not misreads

    def release(self) -> None:
        """Give this copy's buffers back to the pool; the copy must not be used afterwards (after a write)."""
        HOST_POOL.give([*self.weights.values(), *self.optimizer.values()])
        self.weights, self.optimizer = {}, {}

    def write(self, uri: str, storage_options: dict | None = None) -> int:
        """Write to a directory or fsspec URI (replacing a state there); returns the bytes written."""
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        fs.makedirs(root, exist_ok=True)
        meta_path = f"{root}/{META}"
        if fs.exists(meta_path):
            fs.rm(meta_path)  # first, so that a write cut short leaves no complete-looking mix of two states
        written = _write_tensors(fs, f"{root}/{WEIGHTS}", self.weights)
        written += _write_tensors(fs, f"{root}/{OPTIMIZER}", self.optimizer)
        meta = json.dumps(self.meta).encode()
        fs.pipe_file(meta_path, meta)  # last
        return written + len(meta)

    @classmethod
    def read(cls, uri: str, storage_options: dict | None = None) -> HostCopy:
        """Read a state that ``write`` wrote (into pinned memory on a GPU machine).

        Raises:
            FileNotFoundError: no complete state at ``uri``.
        """
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        try:
            meta = json.loads(fs.cat_file(f"{root}/{META}"))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no training state at {uri}: {META} is missing (nothing was parked there, or its write did not "
                "finish)"
            ) from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"training state at {uri} has format {meta.get('format')}, this version reads {FORMAT}")
        weights = {k: _pinned(v) for k, v in _read_tensors(fs, f"{root}/{WEIGHTS}").items()}
        tensors = {k: _pinned(v) for k, v in _read_tensors(fs, f"{root}/{OPTIMIZER}").items()}
        return cls(weights, tensors, meta)


def state_problem(uri: str, storage_options: dict | None = None, *, version: int | None = None) -> str | None:
    """What is wrong with the stored state at ``uri`` (missing, cut short, unreadable, or not of ``version``
    when one is given), or None if it looks whole.

    Cheap: it reads the JSON file and the safetensors headers, and checks that each file is as long as its
    header says; it does not read the tensors (bytes flipped inside a tensor go unnoticed).
    """
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    try:
        meta = json.loads(fs.cat_file(f"{root}/{META}"))
    except FileNotFoundError:
        return f"has no {META} (it was never written, removed, or its write did not finish)"
    except (ValueError, UnicodeDecodeError) as exc:
        return f"has a {META} that does not parse ({exc})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"has a {META} of another format ({meta.get('format') if isinstance(meta, dict) else meta!r})"
    if version is not None and meta.get("version") != version:
        return f"holds v{meta.get('version')}"
    if "ranks" in meta:  # a sharded state: its index is written once every rank's shards are
        return None if fs.exists(f"{root}/{sharding.SHARDS}/{sharding.INDEX}") else "has no index of its shards"
    for name in (WEIGHTS, OPTIMIZER):
        problem = _tensor_file_problem(fs, f"{root}/{name}")
        if problem is not None:
            return f"has a damaged {name}: {problem}"
    return None


def _tensor_file_problem(fs, path: str) -> str | None:
    # safetensors layout: an 8-byte little-endian header length, a JSON header of data offsets, the data
    try:
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= length <= size - 8:
                return f"{size} bytes, too short for its header"
            header = json.loads(f.read(length))
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except FileNotFoundError:
        return "missing"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"its header does not parse ({type(exc).__name__}: {exc})"
    expected = 8 + length + max(ends, default=0)
    return None if size == expected else f"{size} bytes where its header needs {expected}"


class TrainingState:
    """Where one agent's training state is now; ``to`` is the one way to move it.

    Args:
        agent: the agent the state belongs to.
        location: ``"device"``, ``"host"``, or a directory / fsspec URI.
        trainer: the trainer holding it, when at ``"device"`` or ``"host"`` in a trainer.
        copy: the detached host copy, when at ``"host"`` without a trainer.
        storage_options: fsspec options to read it back from ``location`` when that is a URI.
    """

    def __init__(self, agent: str, location: str, *, trainer=None, copy: HostCopy | None = None,
                 storage_options: dict | None = None) -> None:
        self.agent, self.location, self.trainer, self.copy = agent, location, trainer, copy
        self.storage_options = storage_options or {}
        self.stored_bytes = 0  # bytes of the last write to a directory or URI

    @classmethod
    def of(cls, trainer) -> TrainingState:
        """The state a live trainer holds: on its accelerator, or in host memory after ``to("host")``."""
        first = next(iter(trainer.params.values()))
        on_host = trainer.accelerator.device.type != "cpu" and first.device.type == "cpu"
        return cls(trainer.agent, HOST if on_host else DEVICE, trainer=trainer)

    @classmethod
    def at(cls, agent: str, uri: str | Path, *, storage_options: dict | None = None) -> TrainingState:
        """The state of ``agent`` stored at a directory or URI (nothing is read until it moves)."""
        return cls(agent, str(uri), storage_options=storage_options)

    def to(self, location: str | Path, *, trainer=None, storage_options: dict | None = None) -> TrainingState:
        """Move the state to ``location`` and return ``self``.

        Args:
            location: ``"device"``, ``"host"``, or a directory / fsspec URI to write it to. After a write
                the trainer that held the state no longer counts as holding it (drop it, or give it another
                state).
            trainer: the trainer that takes the state (``"device"``, or ``"host"`` inside a trainer); by
                default the one holding it. Without a trainer, ``"host"`` means a detached host copy.
            storage_options: fsspec options of ``location`` when it is a URI.

        Raises:
            ValueError: ``"device"`` with no trainer to hold the state, or a trainer of another agent.
            FileNotFoundError: the state is at a URI where no complete state was written.
        """
        target = str(location)
        if target in (DEVICE, HOST):
            holder = trainer if trainer is not None else self.trainer
            if holder is None and target == DEVICE:
                raise ValueError(f"the state of {self.agent!r} goes onto a device through a trainer: pass trainer=")
            if holder is not None and holder.mesh is not None and holder is not self.trainer:
                _read_sharded(holder, self.location)  # a sharded state lives in trainers or in its files only
                self.trainer = holder
            elif holder is None:
                self.copy = self._host_copy()
            elif holder is self.trainer and target == self.location:
                return self
            elif holder.mesh is not None:
                raise NotImplementedError(f"the sharded state of {self.agent!r} moves through its files (a directory); "
                                          "a move between host and device memory is not built yet")
            else:
                if holder is not self.trainer:
                    self._host_copy().apply(holder)
                    self.trainer, self.copy = holder, None
                _move_live(holder, target)
        elif target != self.location and self.trainer is not None and self.trainer.mesh is not None:
            self.stored_bytes = _write_sharded(self.trainer, target)
            self.trainer = None
        elif target != self.location:
            options = storage_options or {}
            copy = self._host_copy()
            self.stored_bytes = copy.write(target, options)
            copy.release()
            self.trainer = self.copy = None
            self.storage_options = options
        self.location = target
        return self

    def _host_copy(self) -> HostCopy:
        if self.copy is not None:
            return self.copy
        if self.trainer is not None:
            return HostCopy.capture(self.trainer)
        copy = HostCopy.read(self.location, self.storage_options)
        if copy.agent != self.agent:
            raise ValueError(f"state in {self.location} belongs to agent {copy.agent!r}, not {self.agent!r}")
        return copy


def _write_sharded(trainer, uri: str) -> int:
    """Every rank writes its shards; rank 0 writes the JSON file once all have. Returns this rank's bytes."""
    if trainer.step_under_way:
        raise RuntimeError(f"agent {trainer.agent!r} is in the middle of the update to v{trainer.version + 1}: "
                           "a sharded state moves between steps")
    root = _local_dir(uri)
    if sharding.rank() == 0:  # first, so that a write cut short leaves no complete-looking mix of two states
        root.mkdir(parents=True, exist_ok=True)
        (root / META).unlink(missing_ok=True)
    sharding.save(trainer.model, trainer.optimizer, str(root / sharding.SHARDS))  # returns once the index is
    weights = trainer.weights()  # whole on rank 0, for a rollout engine that loads this state's weights
    if sharding.rank() == 0:
        # each name its own copy: safetensors refuses tensors that share memory (tied embeddings)
        save_file({k: v.clone() for k, v in weights.items()}, str(root / WEIGHTS))
        meta = {"format": FORMAT, "agent": trainer.agent, "version": trainer.version, "ranks": trainer.ranks,
                "sharding": trainer.config.sharding,
                "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
                "rng": {"cpu": torch.get_rng_state().tolist()}}
        (root / META).write_text(json.dumps(meta))
    return sharding.held_bytes(trainer.policy_state(), trainer.optimizer)


def _read_sharded(trainer, uri: str) -> None:
    root = _local_dir(uri)
    try:
        meta = json.loads((root / META).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no training state at {uri}: {META} is missing (nothing was parked there, or its "
                                "write did not finish)") from None
    sharded = meta.get("sharding", "full") if "ranks" in meta else "none"  # written before 'optimizer' was: 'full'
    if sharded != trainer.config.sharding:
        raise ValueError(f"the state at {uri} was written with training.sharding={sharded!r}, and agent "
                         f"{trainer.agent!r}'s trainer has {trainer.config.sharding!r}: a run keeps one sharding "
                         "for its whole life")
    if meta["agent"] != trainer.agent:
        raise ValueError(f"the state belongs to agent {meta['agent']!r}, not {trainer.agent!r}")
    sharding.load(trainer.model, trainer.optimizer, str(root / sharding.SHARDS))
    if trainer.scheduler is not None and meta["scheduler"] is not None:
        trainer.scheduler.load_state_dict(meta["scheduler"])
    trainer.version = meta["version"]
    torch.set_rng_state(torch.tensor(meta["rng"]["cpu"], dtype=torch.uint8))


def _local_dir(uri: str) -> Path:
    fs, root = fsspec.core.url_to_fs(uri)
    if not isinstance(fs, LocalFileSystem):
        raise ValueError(f"a sharded state is parked in a local or shared directory, not at {uri}")
    return Path(root)


def _write_tensors(fs, path: str, tensors: dict[str, torch.Tensor]) -> int:
    if isinstance(fs, LocalFileSystem):
        # straight to a file (no bytes in between: about twice as fast), then renamed over the old one, so
        # that a reader of the old file keeps a whole file
        save_file(tensors, f"{path}.partial")
        fs.mv(f"{path}.partial", path)
        return fs.size(path)
    blob = save_tensors(tensors)
    fs.pipe_file(path, blob)
    return len(blob)


def _read_tensors(fs, path: str) -> dict[str, torch.Tensor]:
    if isinstance(fs, LocalFileSystem):
        # copies that own their memory: the loaded tensors may map the file, which a later park replaces
        return {k: v.clone() for k, v in load_file(path).items()}
    return load_tensors(fs.cat_file(path))


def _move_live(trainer, location: str) -> None:
    """Move a trainer's weights and optimizer tensors to its accelerator or to host memory.

    On a GPU, host copies go through the pool's pinned buffers, which go back to the pool when the state
    returns to the device. On a CPU-only machine both places are host memory and the move is a copy.
    """
    to_host = location == HOST
    device = trainer.accelerator.device if not to_host else torch.device("cpu")
    left: list[torch.Tensor] = []  # the host tensors the state leaves behind
    for p in trainer.params.values():  # an adapter agent's own: the base it shares stays where it is
        left.append(p.data)
        p.data = _host(p.data, non_blocking=True) if to_host else p.data.to(device, copy=True)
    for per_param in trainer.optimizer.state.values():
        for name, value in per_param.items():
            if torch.is_tensor(value) and value.dim() > 0:  # AdamW's step counts stay where torch keeps them
                left.append(value)
                per_param[name] = _host(value, non_blocking=True) if to_host else value.to(device, copy=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies must land before anyone reads them
    if not to_host:
        HOST_POOL.give(left)


def _host(t: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """A contiguous host copy of ``t`` in a buffer of the pool (pinned on a GPU machine)."""
    buffer = HOST_POOL.take(t)
    buffer.copy_(t, non_blocking=non_blocking)
    return buffer


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` where a device copies from it fastest: in a pinned buffer of the pool on a GPU machine."""
    return _host(t) if HOST_POOL.pin else t
