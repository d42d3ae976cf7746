"""Rebuild an agent's training state of a version from an earlier one and the updates its store recorded.

The store is the log of training. Each update row names the samples it consumed, in the order they were
accumulated, and each sample keeps what it was trained with: prompt and response tokens, behaviour
log-probs, the policy version that generated it, and its advantage. Training is deterministic, so replaying
the updates after version B on the state of B gives the state the run had at each later version. The replay
cuts the consumed samples into micro-batches of ``micro_batch_size``, as the pipeline committed them; where
a committed micro-batch was shorter the result differs by float rounding at most (gradients add up in
float64, in any order).

Used where an agent's state of a version is needed and its snapshot is missing (``run.snapshot_every`` > 1
writes one every k versions only) or damaged: at resume, and when a lost trainer or replica is rebuilt
mid-run (``ensure_snapshot``: replayed from the newest whole snapshot before it, or from the model directory
at v0); and as the oracle of runs whose schedule of versions depends on timing (``run.max_staleness`` > 0):
their weights must equal the replay of their own store.

Example:
    >>> updates = recorded_updates(store, "solver", after=2, upto=4)     # the updates to v3 and v4
    >>> replay(trainer_at_v2, store, updates, micro_batch_size=8)       # the trainer is now at v4
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc

from flexmarl.cluster.worker_state import EngineKey, worker_address
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import TrainerGroup
from flexmarl.training.snapshots import (
    SnapshotError,
    newest_whole_snapshot,
    require_snapshot,
    restore_trainer,
    save_snapshot,
    snapshot_problem,
    snapshot_uri,
    version_lock,
)
from flexmarl.training.trainer import AgentTrainer, TrainBatch
from storage.store import UPDATES, ExperienceStore, StoreSpec


class ReplayError(SnapshotError):
    """The store lacks what a replay needs (an update, or a sample an update consumed)."""


@dataclass(frozen=True)
class RecordedUpdate:
    """One update as the store recorded it: the version it produced and the samples it consumed, in order."""

    version: int
    consumed_ids: list[str]


def recorded_updates(store: ExperienceStore, agent: str, *, after: int, upto: int) -> list[RecordedUpdate]:
    """``agent``'s updates to versions ``after + 1`` .. ``upto``, oldest first.

    Raises:
        ReplayError: one of those versions has no update row.
    """
    wanted = (pc.field("agent") == agent) & (pc.field("policy_version") > after) & (pc.field("policy_version") <= upto)
    rows = store.read(UPDATES, columns=["policy_version", "consumed_ids"], filter=wanted).to_pylist()
    updates = sorted((RecordedUpdate(r["policy_version"], r["consumed_ids"]) for r in rows), key=lambda u: u.version)
    missing = sorted(set(range(after + 1, upto + 1)) - {u.version for u in updates})
    if missing:
        raise ReplayError(f"the store records no update of agent {agent!r} to v{missing[0]}, so its updates from "
                          f"v{after + 1} to v{upto} cannot be replayed; check the store with `flexmarl store verify`")
    return updates


def replay(trainer: AgentTrainer, store: ExperienceStore, updates: Sequence[RecordedUpdate],
           micro_batch_size: int) -> None:
    """Train ``trainer`` through ``updates`` (from its current version on), on the samples each consumed."""
    table = store.samples_table(trainer.agent)
    for update in updates:
        if trainer.version != update.version - 1:
            raise ReplayError(f"agent {trainer.agent!r} is at v{trainer.version}; the update to v{update.version} "
                              "cannot be replayed on it")
        ids = update.consumed_ids
        if ids:
            rows = store.read(table, filter=pc.field("sample_id").isin(pa.array(ids, pa.string())))
            row_of = dict(zip(rows["sample_id"].to_pylist(), range(rows.num_rows), strict=True))
            lost = [i for i in ids if i not in row_of]
            if lost:
                raise ReplayError(f"the update of agent {trainer.agent!r} to v{update.version} consumed {len(ids)} "
                                  f"samples; {len(lost)} of them (first {lost[0]!r}) are not in {table}")
            for start in range(0, len(ids), micro_batch_size):
                chunk = rows.take([row_of[i] for i in ids[start:start + micro_batch_size]])
                trainer.accumulate(TrainBatch.from_arrow(chunk))
        # with nothing accumulated: an empty (or a skipped) update, the version advances. A sharded trainer's
        # ranks each replay their part of every micro-batch (``accumulate``), and sum their gradients here
        trainer.finish_step()


@dataclass(frozen=True)
class StateSource:
    """Where a worker finds (or rebuilds) an agent's training state of ``version``: small, sent with a task."""

    key: EngineKey  # the agent's engines
    model_dir: str
    config: TrainerConfig
    temperature: float
    max_new_tokens: int
    root: str  # the run's snapshot location
    version: int
    store: StoreSpec
    storage_options: dict

    @property
    def agent(self) -> str:
        return self.key.agent

    @property
    def uri(self) -> str:
        return snapshot_uri(self.root, self.agent, self.version)


class StateSources:
    """Where workers find each agent's training state of a version, for the pipeline's recovery tasks."""

    def __init__(self, root: str | None, base: dict[str, StateSource]) -> None:
        self.root, self.base = root, base  # base: per agent, its source with any version

    def at(self, agent: str, version: int) -> StateSource | None:
        """None at v0 (the model directory).

        Raises:
            SnapshotError: the run writes no states (``run.save_state=false``) and ``version`` is past 0.
        """
        if version == 0:
            return None
        if self.root is None:
            require_snapshot(None, agent, version)  # raises: the run writes nothing to restart from
        return replace(self.base[agent], version=version)


def ensure_snapshot(source: StateSource) -> str:
    """On any worker: the agent's snapshot of ``source.version``, written first if it is missing or damaged,
    by a trainer of its own (never the agent's live one) restored from the newest whole snapshot before it
    and replayed through the updates the store recorded since. Returns its URI.

    Workers that need the same version at once (a lost worker's trainer and replica) take turns on a file
    lock where the snapshots are on a local file system, so one rebuilds it and the others read it; a background
    write of that version (``save_snapshot``) holds the same lock, so they wait for it rather than rebuild.
    """
    with version_lock(source.root, source.agent, source.version, source.storage_options) or nullcontext():
        problem = snapshot_problem(source.root, source.agent, source.version, source.storage_options)
        if problem is None:
            return source.uri
        if source.config.sharded:
            raise SnapshotError(
                f"the snapshot of sharded agent {source.agent!r} at v{source.version} {problem}: a sharded state is "
                "rebuilt only by its ranks together (when they are restored), not on one worker; an engine loads "
                "a version the run wrote and catches up from the trainer")
        _rebuild(source, newest_whole_snapshot(source.root, source.agent, source.version, source.storage_options))
    return source.uri


def restore_at(source: StateSource) -> str:
    """Rebuild the agent's trainer on this worker at ``source.version`` (``restore_trainer`` from its snapshot,
    rebuilt first if missing). Returns the worker's address."""
    return restore_trainer(source.key, source.model_dir, source.config, source.temperature, source.max_new_tokens,
                           ensure_snapshot(source), source.version, source.storage_options)


def rebuild_trainer(source: StateSource, base: int, group: TrainerGroup | None = None) -> str:
    """The agent's trainer rebuilt on this worker at ``source.version`` from its snapshot of ``base`` (0: its
    model directory) and the store's updates since, and a replayed version written as its snapshot. A sharded
    agent's runs on every rank of its ``group`` at once: every rank replays the same updates in the same order (so
    their collectives meet), each its part of each micro-batch, and the ranks write their shards together.
    Returns the worker's address."""
    key, root, options = source.key, source.root, source.storage_options
    restore_trainer(key, source.model_dir, source.config, source.temperature, source.max_new_tokens,
                    snapshot_uri(root, source.agent, base) if base else None, base, options, group)
    if base < source.version:
        held, opened = slot.trainer(key), source.store.open()
        replay(held, opened, recorded_updates(opened, source.agent, after=base, upto=source.version),
               source.config.micro_batch_size)
        if held.fsdp:
            slot.gather_weights(key)  # its home keeps the replayed weights whole, for the syncs
        save_snapshot(key, root, source.version, options)
    return worker_address()


def _rebuild(source: StateSource, base: int, group: TrainerGroup | None = None) -> None:
    """Write the snapshot of ``source.version`` by a trainer of its own (``rebuild_trainer``), never the agent's
    live one, dropped after."""
    # under the run's key, so that the run's release frees what it leaves (an adapter agent's own base)
    scratch = replace(source, key=replace(source.key, scope="~replay"))
    try:
        rebuild_trainer(scratch, base, group)
    finally:
        slot.drop_trainer(scratch.key)


def ensure_group_snapshot(source: StateSource, base: int, group: TrainerGroup) -> str:
    """``ensure_snapshot`` for a sharded agent, on every rank of ``group`` at once, from its snapshot of ``base``.
    Returns its URI."""
    _rebuild(source, base, group)
    return source.uri


def after_snapshot(source: StateSource | None, fn, *args):  # noqa: ANN001, ANN201 - any worker function
    """``fn(*args)`` on this worker once the snapshot of ``source`` is whole (rebuilt first if missing; None:
    version 0, the model directory): for a replica that loads the weights of a version whose state the run
    did not write."""
    if source is not None:
        ensure_snapshot(source)
    return fn(*args)
