"""The driver side of a run: start the engines on Dask, run the pipeline.

Once a run directory is laid out (``flexmarl/run/plan.py`` and ``prepare.py``), a ``Runtime`` starts each
agent's rollout replicas and trainer on the Dask workers, runs the pipeline (``pipeline.py``) under the
schedule the config asks for, and saves checkpoints. It is used by the Prefect flow and by the benchmarks
alike, so both run the same engine.

A resumed run is a run like any other: the store says each agent's version, its engines start from its
training-state snapshot of that version, and the pipeline replays the samples already committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from distributed import Client, TimeoutError as DaskTimeoutError

from flexmarl.cluster.local import ClusterError, connect, place, submit_on, workers_offering
from flexmarl.cluster.worker_state import EngineKey, release
from flexmarl.config import RunConfig, load_config
from flexmarl.models.loading import load_tokenizer, resolve_model
from flexmarl.orchestrator.pipeline import PipelineRunner, StopFlag
from flexmarl.orchestrator.records import PipelineEvent, PipelineResult
from flexmarl.orchestrator.policy import SchedulePolicy, deal_replicas, sharded_ranks
from flexmarl.rollout import replica
from flexmarl.training import group, replay, slot, snapshots
from flexmarl.workloads.datasets import problem_stream
from flexmarl.run.layout import CHECKPOINTS_DIR, CONFIG_FILE, STATE_DIR
from flexmarl.run.plan import attempts
from storage.store import ExperienceStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunContext:
    """What identifies a run: small and picklable, passed between control-plane tasks."""

    run_id: str
    run_dir: str
    store_uri: str
    address: str  # Dask scheduler


def training_slots(slots: int | None, train_workers: list[str], sharded: dict[str, int] | None = None) -> list[str]:
    """The training workers that serve as slots: the first ``slots`` of them (all when None), enough for each
    sharded agent's ranks (``sharded``: agent -> its ``training.max_slots``)."""
    if slots is not None and slots > len(train_workers):
        raise ClusterError(
            f"training.slots={slots} but only {len(train_workers)} training worker(s) exist; lower training.slots "
            "(null: one slot per training worker) or start more workers"
        )
    chosen = train_workers[:slots]
    for agent, span in (sharded or {}).items():
        if span > len(chosen):
            raise ClusterError(
                f"agent {agent!r} is sharded over training.max_slots={span} slots but only {len(chosen)} training "
                f"slot(s) exist; lower agents.{agent}.training.max_slots (its state then splits into fewer shards) "
                "or start more workers")
    return chosen


def schedule_policy(cfg: RunConfig) -> SchedulePolicy:
    return SchedulePolicy(
        mode=cfg.run.mode,
        steps=cfg.run.steps,
        pipeline=cfg.run.pipeline,
        micro_batch_generation=cfg.rollout.micro_batch_generation,
        max_staleness={
            a: spec.max_staleness if spec.max_staleness is not None else cfg.run.max_staleness
            for a, spec in cfg.agents.items()
        },
    )


@dataclass(frozen=True)
class Placement:
    """Where a run's engines are: what a task needs, besides the ``RunContext``, to reach them.

    ``start_engines`` returns it, the pipeline task returns it again (agents may have moved between slots),
    and each control-plane task attaches a ``Runtime`` to it; small and picklable, like the context.
    """

    trainers: dict[str, str]  # agent -> the training worker that holds its trainer
    slots: list[str]  # the training workers that serve as slots
    engines: dict[str, list[str]]  # agent -> the rollout workers that hold its replicas
    replicas: list[tuple[str, str]]  # (worker, agent) of each rollout replica
    versions: dict[str, int]  # agent -> its policy version

    def describe(self) -> dict[str, dict]:
        return {a: {"trainer": w, "engines": self.engines[a], "replicas": [r for r, x in self.replicas if x == a]}
                for a, w in self.trainers.items()}


class Runtime:
    """Driver-side handle of one run: a Dask client, the run's config and store, and where its engines are.

    A new run's placement is dealt from the cluster's workers; ``placement`` attaches to engines already
    started (by another task, perhaps in another process). ``disconnect`` leaves the engines to the run;
    ``close`` frees them.
    """

    def __init__(self, ctx: RunContext, cfg: RunConfig | None = None, placement: Placement | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg or load_config(Path(ctx.run_dir) / CONFIG_FILE)
        self.store = ExperienceStore.from_config(ctx.store_uri, self.cfg.store)
        self.client: Client = connect(ctx.address, timeout_s=self.cfg.cluster.connect_timeout_s)
        self.model_dirs = {a: str(resolve_model(s.model, seed=self.cfg.run.seed)) for a, s in self.cfg.agents.items()}
        if placement is None:
            placement = self._deal()
        self.trainers, self.slots = dict(placement.trainers), list(placement.slots)
        self.engines, self.replicas = dict(placement.engines), list(placement.replicas)
        self.versions = dict(placement.versions)
        self.timeout_s = self.cfg.rollout.request_timeout_s
        self.state_uri = (self.cfg.training.state_uri or str(Path(ctx.run_dir) / STATE_DIR)).rstrip("/")
        self.snapshot_root = f"{self.state_uri}/{snapshots.SNAPSHOTS}" if self.cfg.run.save_state else None

    def _deal(self) -> Placement:
        cluster = self.cfg.cluster
        rollout_workers = workers_offering(self.client, cluster.rollout_resource, "rollout")
        train_workers = workers_offering(self.client, cluster.train_resource, "training")
        # Agents start on the training slots round-robin and bind a free slot whenever they have work (M <= N
        # is fine; a slot swaps states on and off its device). Rollout replicas are dealt round-robin too; with
        # load balancing every rollout worker holds an engine of every agent so that replicas can move.
        slots = training_slots(self.cfg.training.slots, train_workers,
                               {a: self.cfg.trainer_config(a).max_slots for a in self._sharded()})
        replicas = deal_replicas(list(self.cfg.agents), rollout_workers, self.cfg.rollout.replicas_per_worker)
        engines = {
            a: list(rollout_workers) if self.cfg.rollout.load_balance
            else sorted({w for w, agent in replicas if agent == a})
            for a in self.cfg.agents
        }
        versions = {a: self.store.policy_version(a) for a in self.cfg.agents}
        trainers = place(list(self.cfg.agents), slots)
        for agent in self._sharded():  # its home is its first rank
            trainers[agent] = sharded_ranks(slots, self.cfg.trainer_config(agent).max_slots)[0]
        return Placement(trainers, slots, engines, replicas, versions)

    def _sharded(self) -> list[str]:
        return [a for a in self.cfg.agents if self.cfg.trainer_config(a).sharded]

    @property
    def placement(self) -> Placement:
        return Placement(dict(self.trainers), list(self.slots), dict(self.engines), list(self.replicas),
                         dict(self.versions))

    def key(self, agent: str) -> EngineKey:
        return EngineKey(self.ctx.run_id, agent)

    def _wait(self, futures: list, what: str, scale: int = 1) -> list:
        """The futures' results, all within ``scale`` times ``rollout.request_timeout_s`` from now."""
        deadline = time.monotonic() + self.timeout_s * scale
        try:
            return [f.result(timeout=max(deadline - time.monotonic(), 0.0)) for f in futures]
        except (TimeoutError, DaskTimeoutError):
            bound = "rollout.request_timeout_s" if scale == 1 else f"{scale} x rollout.request_timeout_s"
            raise TimeoutError(
                f"{what} did not finish within {self.timeout_s * scale:.0f}s ({bound}); check the Dask "
                "workers' logs, or raise the timeout for large models"
            ) from None

    def start_engines(self) -> Placement:
        """Load every agent's replicas and trainer on their workers. Returns the placement.

        An agent past version 0 (a resumed run) starts from its training-state snapshot of that version.
        """
        self._release_earlier_attempts()
        options = self.cfg.training.state_storage_options
        futures = []
        sharded = self._sharded()
        # a sharded agent's ranks form their world (each builds its shards of the trainer) while this serves it
        rendezvous = group.Rendezvous(self.client.scheduler.address) if sharded else None
        for agent, spec in self.cfg.agents.items():
            version, model_dir = self.versions[agent], self.model_dirs[agent]
            trainer_args = (self.cfg.trainer_config(agent), spec.sampling.temperature, spec.sampling.max_new_tokens)
            ranks, world = (self.trainers[agent],), None
            if agent in sharded:
                ranks = sharded_ranks(self.slots, self.cfg.trainer_config(agent).max_slots)
                world = group.TrainerGroup(group.world_name(self.ctx.run_id, "start"), ranks, rendezvous.address,
                                           self.timeout_s)
            snapshot = self._resume_snapshot(agent, version, trainer_args, world)
            for worker in self.engines[agent]:
                if snapshot is None:
                    futures.append(submit_on(self.client, worker, replica.start_replica, self.key(agent), model_dir,
                                             version, self.cfg.rollout, spec.adapter))
                else:
                    futures.append(submit_on(self.client, worker, replica.restart_replica, self.key(agent),
                                             model_dir, version, self.cfg.rollout, snapshots.weights_uri(snapshot),
                                             options, spec.adapter))
            for worker in ranks:
                if snapshot is None:
                    futures.append(submit_on(self.client, worker, slot.start_trainer, self.key(agent),
                                             model_dir, *trainer_args, version, world))
                else:
                    futures.append(submit_on(self.client, worker, snapshots.restore_trainer, self.key(agent),
                                             model_dir, *trainer_args, snapshot, version, options, world))
        self._wait(futures, "starting the engines")
        return self.placement

    def _resume_snapshot(self, agent: str, version: int, trainer_args: tuple,
                         world: group.TrainerGroup | None) -> str | None:
        """The snapshot ``agent`` restarts from at ``version`` (None at v0: its model directory).

        A missing or damaged one is rebuilt first, on the agent's training worker, from the newest whole
        snapshot before it and the updates the store recorded since (``replay.ensure_snapshot``, as a recovery
        task mid-run does); a sharded agent's by every rank of its ``world`` together
        (``replay.ensure_group_snapshot``).
        """
        root, options = self.snapshot_root, self.cfg.training.state_storage_options
        if version == 0 or root is None:
            return snapshots.require_snapshot(root, agent, version, options)  # None, or why it cannot restart
        problem = snapshots.snapshot_problem(root, agent, version, options)
        if problem is not None:
            base = snapshots.newest_whole_snapshot(root, agent, version, options)
            n = version - base
            skipped = version - version % self.cfg.run.snapshot_every == base  # by run.snapshot_every: expected
            (log.info if skipped else log.warning)(
                "the snapshot of agent %r at v%d %s: rebuilding it from %s by replaying the %d update%s the store "
                "recorded since", agent, version, problem, f"its snapshot of v{base}" if base else "its model (v0)",
                n, "" if n == 1 else "s")
            source = replay.StateSource(self.key(agent), self.model_dirs[agent], *trainer_args, root, version,
                                        self.store.spec, options)
            if world is None:
                futures = [submit_on(self.client, self.trainers[agent], replay.ensure_snapshot, source)]
            else:
                futures = [submit_on(self.client, w, replay.ensure_group_snapshot, source, base, world)
                           for w in world.members]
            self._wait(futures, f"rebuilding the snapshot of {agent!r} at v{version}", scale=version - base)
        return snapshots.snapshot_uri(root, agent, version)

    def _release_earlier_attempts(self) -> None:
        """Free engines that earlier attempts of this run directory left on a cluster that outlived them."""
        for run_id, _ in attempts(self.ctx.run_dir):
            if run_id != self.ctx.run_id:
                free_engines(self.client, run_id, self.cfg.cluster.connect_timeout_s)

    def run(
        self, *, train: bool = True, on_event: Callable[[PipelineEvent], None] | None = None,
        stop_requested: StopFlag | None = None, on_submit: Callable[[str, str, str], None] | None = None,
    ) -> PipelineResult:
        """Run every agent's updates under the configured schedule.

        ``train=False`` only samples (and commits) the steps' episodes: the rollout benchmark. ``on_event`` is
        told what happens (``records.PipelineEvent``), in the pipeline loop's thread. ``stop_requested`` (a
        ``threading.Event`` or ``channel.StopSignal``) stops the loop at its next turn, with ``PipelineStopped``;
        the run can be resumed from the store. ``on_submit`` is called with (kind, agent, worker) after each
        task the pipeline submits (fault injection).
        """
        runner = PipelineRunner(
            client=self.client, cfg=self.cfg, policy=schedule_policy(self.cfg), store=self.store,
            run_key=self.ctx.run_id, tokenizers={a: load_tokenizer(Path(d)) for a, d in self.model_dirs.items()},
            engines=self.engines, replicas=self.replicas, trainers=self.trainers, slots=self.slots,
            model_dirs=self.model_dirs, state_uri=self.state_uri, versions=self.versions,
            problems=problem_stream(self.cfg.data), on_event=on_event, train=train,
            snapshot_root=self.snapshot_root if train else None, on_submit=on_submit,
        )
        if stop_requested is not None:
            runner.stop_requested = stop_requested
        try:
            result = runner.run()
        finally:
            self.trainers = dict(runner.location)  # agents may have moved between slots
            self.versions = dict(runner.versions)
        return result

    def weights(self, agent: str) -> dict[str, torch.Tensor]:
        """The agent's current trained weights (copied to this process)."""
        fut = submit_on(self.client, self.trainers[agent], slot.weights, self.key(agent))
        return self._wait([fut], f"fetching the weights of {agent!r}")[0]

    def checkpoint(self, agent: str) -> str:
        out = Path(self.ctx.run_dir) / CHECKPOINTS_DIR / agent / f"v{self.versions[agent]}"
        fut = submit_on(self.client, self.trainers[agent], slot.save_checkpoint, self.key(agent), str(out),
                        self.model_dirs[agent])
        return self._wait([fut], f"the checkpoint of agent {agent!r}")[0]

    def disconnect(self) -> None:
        """Close this handle's client; the engines stay on the workers for the run's other tasks."""
        self.client.close(timeout=self.cfg.cluster.connect_timeout_s)

    def close(self) -> None:
        """Free this run's engines on every worker, then disconnect; bounded, and never masks a run's error."""
        try:
            free_engines(self.client, self.ctx.run_id, self.cfg.cluster.connect_timeout_s)
        finally:
            self.disconnect()


def free_engines(client: Client, run_id: str, timeout_s: float) -> None:
    """Free the engines of run ``run_id`` on every worker; logs, and never raises, when it cannot."""
    try:
        # prefetch: states read ahead but never resumed; write: the record of a background state write
        for kind in ("replica", "trainer", "prefetch", group.GROUP, snapshots.WRITES):
            client.run(release, f"{kind}:{run_id}/", callback_timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - clean-up: the engines die with their workers anyway
        log.warning("could not free the engines of run %s within %.0fs: %s", run_id, timeout_s, exc)
