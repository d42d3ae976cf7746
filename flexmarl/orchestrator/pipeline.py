"""The Dask executor: carries out the scheduler's commands on a cluster and reports what finished.

One event loop in the driver keeps every worker fed. The scheduler (``scheduler.py``) decides what runs when;
this module only submits its jobs to the workers they are pinned to, turns finished futures into the
scheduler's events, keeps deadlines, and leaves episodes and store commits to the collector
(``collector.py``). It records a timeline of every worker's busy time.

Faults: every ``run.snapshot_every`` updates the agent's training state is copied before the update is
recorded and written as a snapshot in the background (``training/snapshots.py``); a recovery job that needs a
version without one rebuilds it on its worker by replaying the store's updates since the last
(``training/replay.py``). A run that continues a crashed one replays the samples its store already holds
(``resume.py``). Lost and hung workers are detected by the supervisor (``supervisor.py``); what their work
becomes is decided by ``recovery.py``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Protocol

from distributed import Client, Future, fire_and_forget
from distributed import TimeoutError as DaskTimeoutError

from flexmarl.cluster.local import scheduler_workers, submit_on
from flexmarl.cluster.worker_state import EngineKey, Timed, timed_call
from flexmarl.config import RunConfig
from flexmarl.orchestrator.collector import Collector
from flexmarl.orchestrator.policy import AgentShape, SchedulePolicy
from flexmarl.orchestrator.records import (
    AgentFailed, PipelineEvent, PipelineResult, Span, StateMove, StepOpened, UpdateEvent, WeightSynced,
)
from flexmarl.orchestrator.commands import (
    Cancel, CatchUp, Commit, Discard, Finish, Generate, GroupDone, Job, JobKind, Join, MoveState, Park, Prefetch,
    RecordUpdate, Replay, Restore, Snapshot, StartReplica, StepDone, Sync, Train, overdue,
)
from flexmarl.orchestrator.scheduler import Scheduler
from flexmarl.orchestrator.supervisor import Supervisor
from flexmarl.rollout import replica as replica_fns
from flexmarl.rollout.backend import GenerationRequest, WeightSyncError
from flexmarl.rollout.balancer import InterAgentBalancer
from flexmarl.rollout.episodes import EpisodeGraph, request_seed
from flexmarl.training import replay, slot, snapshots
from flexmarl.training.group import Rendezvous, TrainerGroup, world_name
from flexmarl.training.slot import StateResumed
from flexmarl.training.trainer import UpdateResult
from flexmarl.workloads.datasets import ProblemStream
from storage.store import ExperienceStore

RESULT_WAIT_S = 30.0  # fetching a finished job's value; longer means the worker holding it died meanwhile


@dataclass(frozen=True)
class WeightsFetch:
    """An agent's new weights, fetched once from its trainer for all its engines' syncs."""

    version: int
    future: Future


class PipelineStopped(RuntimeError):
    """The pipeline was asked to stop (its ``stop_requested`` was set); the run can be resumed from its store."""


class StopFlag(Protocol):
    """What the loop asks on each turn: a ``threading.Event``, or a run's ``channel.StopSignal``."""

    def is_set(self) -> bool: ...


def build_scheduler(cfg: RunConfig, policy: SchedulePolicy, *, replicas, engines, slots, location, versions,
                    train: bool = True, snapshot_every: int = 0) -> Scheduler:
    """The run's scheduler, from its config (the simulator builds its own from a preset)."""
    shapes = {}
    for agent, spec in cfg.agents.items():
        trainer = cfg.trainer_config(agent)
        shapes[agent] = AgentShape(trainer.micro_batch_size, spec.sampling.max_new_tokens,
                                   cfg.rollout.max_batch_size, trainer.advantage == "agent", trainer.max_slots,
                                   trainer.sharded)
    balancer = InterAgentBalancer(
        cfg.rollout.balance_threshold, cfg.rollout.balance_cooldown_s,
        min_replicas=1 if len(replicas) >= len(cfg.agents) else 0, lanes=cfg.cluster.threads_per_worker,
    ) if cfg.rollout.load_balance else None
    return Scheduler(policy=policy, graph=cfg.graph.expanded, agents=shapes,
                     queries_per_step=cfg.run.queries_per_step, group_size=cfg.run.group_size,
                     replicas=replicas, engines=engines, slots=slots, location=location,
                     versions=versions, balancer=balancer, train=train, snapshot_every=snapshot_every)


class PipelineRunner:
    """Runs ``cfg.run.steps`` updates of every agent under ``policy``.

    Args:
        client: Dask client of the cluster that holds the engines.
        cfg: the run's config.
        store: the run's experience store (this runner is the only writer of its sample tables).
        run_key: prefix of the engines' registry keys on the workers.
        tokenizers: per agent, for prompts and decoding on the driver.
        engines: per agent, the workers holding its rollout engine (each gets the agent's weight syncs).
        replicas: the rollout replicas, as (worker, agent it serves first); the worker must hold an engine
            of every agent a replica may move to (all of them, when ``rollout.load_balance`` is on).
        trainers: per agent, the worker holding its trainer at the start.
        slots: the training workers; agents bind them on demand.
        model_dirs: per agent, its model directory (to rebuild a trainer on another slot).
        state_uri: a directory or fsspec URI where training states are parked when they move between workers.
        versions: per agent, the starting policy version.
        problems: the problem stream (the run's data, in the order it serves it).
        on_event: called in the loop's thread with what happens as it happens (``records.PipelineEvent``: steps
            opened, micro-batches committed, updates recorded, weights synced, replicas and states moved,
            recoveries, and the agent whose job is about to fail the run).
        train: False samples and commits the steps' episodes without training (the rollout benchmark).
        snapshot_root: where each agent's training state is written every ``run.snapshot_every`` updates (a
            directory or URI under ``training.state_uri``); None writes none, and then a lost trainer past
            version 0 cannot be rebuilt.
        on_submit: called with (kind, agent, worker) after each job is submitted (fault injection in tests
            and ``flexmarl bench chaos``).
    """

    def __init__(
        self, *, client: Client, cfg: RunConfig, policy: SchedulePolicy, store: ExperienceStore, run_key: str,
        tokenizers: dict, engines: dict[str, list[str]], replicas: list[tuple[str, str]],
        trainers: dict[str, str], slots: list[str], model_dirs: dict[str, str], state_uri: str | Path,
        versions: dict[str, int], problems: ProblemStream, on_event: Callable[[PipelineEvent], None] | None = None,
        train: bool = True, snapshot_root: str | None = None, on_submit: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.client, self.cfg, self.store = client, cfg, store
        self.run_key, self.on_event, self.on_submit = run_key, on_event, on_submit
        self.model_dirs, self.snapshot_root = model_dirs, snapshot_root
        self.state_uri = str(state_uri).rstrip("/")
        self.sched = build_scheduler(cfg, policy, replicas=replicas, engines=engines, slots=slots,
                                     location=trainers, versions=versions, train=train,
                                     snapshot_every=cfg.run.snapshot_every if snapshot_root is not None else 0)
        self.graph = EpisodeGraph(cfg, tokenizers)
        self.collector = Collector(cfg, store, self.graph, problems)
        self.trainer_cfg = {a: cfg.trainer_config(a) for a in cfg.agents}
        self.states = replay.StateSources(snapshot_root, {a: replay.StateSource(  # version set where needed
            self.key(a), model_dirs[a], self.trainer_cfg[a], cfg.agents[a].sampling.temperature,
            cfg.agents[a].sampling.max_new_tokens, snapshot_root or "", 0, store.spec,
            cfg.training.state_storage_options) for a in cfg.agents})
        self.timeout_s = cfg.rollout.request_timeout_s
        self.futures: dict[int, Future] = {}  # id(job) -> its future
        self.job_of: dict[Future, Job] = {}
        self.deadlines: dict[Future, float] = {}  # every submitted job's: a frozen worker is found by any of them
        self.prompts: dict[int, list[list[int]]] = {}  # id(generation job) -> its prompts
        self.parks: dict[str, Future] = {}  # agent -> the job writing its state
        self.prefetches: dict[str, Future] = {}  # agent -> the job reading its state ahead
        self.weights: dict[str, WeightsFetch] = {}  # agent -> the fetch of its new weights from its trainer
        self.replay_bases: dict[tuple[str, int], int] = {}  # (sharded agent, formation) -> its rebuild's snapshot
        self.finished_steps: dict[str, list[UpdateResult]] = {}  # agent -> its last optimizer step's, per rank
        self.rendezvous: Rendezvous | None = None  # the trainer groups' store, served once a group first forms
        self.finished: queue.Queue[Future | None] = queue.Queue()  # None: a group was scored
        self.spans: list[Span] = []
        self.updates: list[UpdateEvent] = []
        self.state_moves: list[StateMove] = []
        self.syncs: list[WeightSynced] = []
        self.store_read_s = self.driver_wait_s = 0.0
        self.stop_requested: StopFlag = threading.Event()
        self.moves_told = self.recoveries_told = 0  # how much of each list `on_event` has seen

    @property
    def versions(self) -> dict[str, int]:
        return self.sched.versions

    @property
    def location(self) -> dict[str, str]:
        return self.sched.training.location

    def key(self, agent: str) -> EngineKey:
        return EngineKey(self.run_key, agent)

    # ------------------------------------------------------------------ the loop

    def run(self) -> PipelineResult:
        self.t0 = self.last_progress = time.time()
        self.collector.open(self.sched.next_step)
        self.supervisor = Supervisor(self.client, self.cfg, self.sched.recovery)
        sched, target = self.sched, self.cfg.run.steps
        while True:
            if self.stop_requested.is_set():
                self.client.cancel(list(self.job_of))
                raise PipelineStopped(f"the pipeline was stopped at versions {self.versions}; resume it from the store")
            self._carry_out(self.collector.gate.released())  # here only: what they free is dispatched below
            while (step := sched.admissible()) is not None:
                self.collector.open_step(sched, step)
                trains = tuple(a for a, v in self.versions.items() if self.sched.train and v <= step)
                self._notify(StepOpened(step, trains))
                self._carry_out()
            sched.dispatch(time.time() - self.t0)
            self._carry_out()
            self._notify_lists()
            if not sched.inflight and not sched.recovery.waiting and not self.collector.gate.pending:
                if sched.is_finished(target):
                    break
                raise RuntimeError(f"pipeline stalled with nothing in flight (versions {self.versions})")
            fut = self._next_finished()
            if fut is None or fut not in self.job_of:  # the supervisor acted, or the job was given up
                continue
            try:
                timed: Timed = fut.result(timeout=RESULT_WAIT_S)  # re-raises a job's error here, in the driver
            except (TimeoutError, DaskTimeoutError):
                self.supervisor.poll(force=True)  # the worker holding the value died: its work is redone
                self._carry_out()  # the recovery's commands forget the lost worker's jobs, this one among them
                if fut in self.job_of:  # it holds the value but does not answer (frozen): a hung worker
                    job = self.job_of[fut]
                    self._restart_hung(job, f"the value of finished task {job.kind.label} {job.agent!r} cannot "
                                            f"be fetched from {job.worker} within {RESULT_WAIT_S:.0f}s", TimeoutError)
                continue
            except Exception:
                if self._rank_lost(self.job_of[fut]):
                    continue
                with self._blame(self.job_of[fut]):  # the job's own error fails the run
                    raise
            self.last_progress = time.time()
            job = self.job_of[fut]
            self.supervisor.proven.add(job.worker)
            self._forget(job)
            with self._blame(job):
                self._handle(job, timed)
        workers = sorted(scheduler_workers(self.client))
        c = self.collector
        return PipelineResult(self.t0, time.time() - self.t0, self.spans, self.updates, workers, c.tokens,
                              c.store_write_s, self.store_read_s,
                              balancer.moves if (balancer := sched.rollout.balancer) else [], sched.rollout.queue_trace,
                              self.state_moves,
                              c.generated, c.reused, sched.recovery.recoveries,
                              max(time.time() - self.t0 - self.driver_wait_s, 0.0), self.syncs)

    # ------------------------------------------------------------------ what the caller is told

    def _notify(self, event: PipelineEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _notify_lists(self) -> None:
        """Tell the balancer's replica moves and the recoveries' records (started, finished) not told yet."""
        balancer = self.sched.rollout.balancer
        moves = balancer.moves if balancer else []
        recoveries = self.sched.recovery.told
        for event in [*moves[self.moves_told:], *recoveries[self.recoveries_told:]]:
            self._notify(event)
        self.moves_told, self.recoveries_told = len(moves), len(recoveries)

    @contextmanager
    def _blame(self, job: Job) -> Iterator[None]:
        """An error raised while finishing ``job`` fails the run: tell whose job it was, then let it go on."""
        try:
            yield
        except PipelineStopped:
            raise
        except Exception as exc:
            self._notify(AgentFailed(job.agent, f"{type(exc).__name__}: {exc}"))
            raise

    def _forget(self, job: Job) -> Future | None:
        fut = self.futures.pop(id(job), None)
        if fut is not None:
            self.job_of.pop(fut, None)
            self.deadlines.pop(fut, None)
        return fut

    def _next_finished(self) -> Future | None:
        """The next finished job, or None when the supervisor acted on a lost or hung worker.

        A job past its deadline (``rollout.sync_timeout_s`` for a weight sync, ``rollout.request_timeout_s``
        for the rest) counts as a hung worker, which the supervisor replaces (or, on a worker without a
        nanny, fails fast naming it). With no job in flight, nothing finishing within
        ``rollout.request_timeout_s`` is a stall.
        """
        while True:
            if self.supervisor.poll():
                return None
            deadline = min([self.last_progress + self.timeout_s, *self.deadlines.values()])
            waited = time.time()
            try:
                return self.finished.get(timeout=min(max(deadline - time.time(), 0.0), self.supervisor.poll_s))
            except queue.Empty:
                pass
            finally:
                self.driver_wait_s += time.time() - waited
            now = time.time()
            late = [f for f, d in self.deadlines.items() if d <= now]
            if late:
                job = self.job_of[late[0]]
                self._restart_hung(job, overdue(job, self.cfg.rollout.sync_timeout_s,
                                                self.cfg.rollout.request_timeout_s),
                                   WeightSyncError if isinstance(job, Sync) else TimeoutError)
                return None
            if now >= self.last_progress + self.timeout_s and not self.deadlines and not self.sched.recovery.waiting:
                what = sorted({f"{j.kind.label} {j.agent}" for j in self.sched.inflight})
                raise TimeoutError(f"nothing finished within {self.timeout_s:.0f}s; waiting on {what}")

    def _rank_lost(self, job: Job) -> bool:
        """Did ``job``, a rank's part of a group's optimizer step, fail because another rank's worker was lost?

        The collective fails on the live ranks as soon as a rank's process dies, often before the scheduler
        reports the worker lost: the supervisor is asked until it has (the recovery then gives the step up
        and redoes it) or ``RESULT_WAIT_S`` has passed (then the error is the job's own).
        """
        sharded = self.trainer_cfg[job.agent].sharded and job.kind in (
            JobKind.TRAIN, JobKind.FINISH, JobKind.SNAPSHOT, JobKind.RESTORE)
        if not (isinstance(job, Finish) and job.members) and not sharded:
            return False
        deadline = time.time() + RESULT_WAIT_S
        while time.time() < deadline:
            self.supervisor.poll(force=True)
            self._carry_out()
            if self.futures.get(id(job)) is None:  # given up with the lost rank's group
                return True
            time.sleep(self.supervisor.poll_s / 4)
        return False

    def _restart_hung(self, job: Job, why: str, error: type[Exception]) -> None:
        """Have the supervisor replace ``job``'s hung worker (raising ``error``, blamed on its agent, where it
        cannot); the wait for progress starts again."""
        with self._blame(job):
            self.supervisor.restart({job.worker}, why, error)
        self.last_progress = time.time()

    # ------------------------------------------------------------------ commands out

    def _carry_out(self, released: list[object] | tuple = ()) -> None:
        for cmd in chain(released, self.sched.drain()):  # drain: what a command adds comes too
            if self.collector.gate.held_back(cmd):  # it needs a group whose rewards are still being computed
                continue
            if isinstance(cmd, Job):
                self._submit(cmd)
            elif isinstance(cmd, Replay):
                self.sched.node_done(cmd.request, self.collector.replayed(cmd.request))
            elif isinstance(cmd, GroupDone):  # scored in a thread; the loop wakes when it is done
                self.collector.score_group(cmd.step, cmd.query, lambda: self.finished.put(None))
            elif isinstance(cmd, Commit):
                for event in self.collector.commit(self.sched, cmd):
                    self._notify(event)
            elif isinstance(cmd, StepDone):
                self.collector.step_done(cmd.step)
            elif isinstance(cmd, RecordUpdate):
                self._record_update(cmd.agent, cmd.step)
            elif isinstance(cmd, Prefetch):
                self.prefetches[cmd.agent] = submit_on(
                    self.client, cmd.worker, slot.prefetch, self.key(cmd.agent), self._park_uri(cmd.agent),
                    self.cfg.training.state_storage_options, self.parks.get(cmd.agent),
                    priority=JobKind.PREFETCH.priority)
            elif isinstance(cmd, Discard):
                fn = slot.drop_trainer if cmd.trainer else slot.discard_prefetch
                if not cmd.trainer:
                    self.prefetches.pop(cmd.agent, None)
                fire_and_forget(submit_on(self.client, cmd.worker, fn, self.key(cmd.agent),
                                          priority=JobKind.PREFETCH.priority))
            elif isinstance(cmd, Cancel):
                self.prompts.pop(id(cmd.job), None)
                fut = self._forget(cmd.job)
                if fut is not None:
                    fut.cancel()
            else:
                raise TypeError(f"unknown command {cmd!r}")

    def _park_uri(self, agent: str) -> str:
        return f"{self.state_uri}/{agent}"

    def _call(self, job: Job) -> tuple[Callable, tuple]:
        """The worker function that carries out ``job``, and its arguments."""
        key, agent, options = self.key(job.agent), job.agent, self.cfg.training.state_storage_options
        sampling = self.cfg.agents[agent].sampling
        trainer = (self.model_dirs[agent], self.trainer_cfg[agent], sampling.temperature, sampling.max_new_tokens)
        if isinstance(job, Generate):
            requests = [GenerationRequest(r.sample_id, self.graph.prompt(self.collector.episode(r), r.node),
                                          sampling.max_new_tokens, sampling.temperature,
                                          request_seed(self.cfg.run.seed, r.sample_id)) for r in job.requests]
            self.prompts[id(job)] = [r.prompt_ids for r in requests]
            return replica_fns.generate, (key, requests)
        if isinstance(job, Train):
            stored = job.batch.stored
            return slot.accumulate, (key, self.store.spec, stored.version, list(stored.sample_ids), job.batch.step)
        if isinstance(job, Finish):
            return slot.finish_step, (key, self._group(job))
        if isinstance(job, Snapshot):
            version = self.finished_steps[agent][0].policy_version
            return snapshots.save_snapshot, (key, self.snapshot_root, version, options, job.background)
        if isinstance(job, Sync) and job.in_place:  # the trainer's weights never leave its device
            return replica_fns.load_trainer_weights, (key, job.version)
        if isinstance(job, Sync) and job.source is not None:
            fetch = self.weights.get(agent)
            if fetch is None or fetch.version != job.version:  # one fetch for all the agent's engines
                self.weights[agent] = fetch = WeightsFetch(
                    job.version, submit_on(self.client, job.source, slot.weights, key))
            return replica_fns.load_weights, (key, job.version, fetch.future)
        if isinstance(job, (Sync, CatchUp)):  # the trainer that made the version is gone, or an engine is late
            state = self.states.at(agent, job.version)
            return replay.after_snapshot, (state, replica_fns.load_weights_from, key, job.version,
                                           snapshots.weights_uri(state.uri), options)
        if isinstance(job, Park):
            return slot.park, (key, self._park_uri(agent), options)
        if isinstance(job, (MoveState, Join)):  # a join resumes the state of the step's start; the home keeps its own
            after = self.prefetches.pop(agent, None) if isinstance(job, MoveState) and job.prefetched else None
            return slot.resume, (key, *trainer, self._park_uri(agent), self.versions[agent],
                                 after or self.parks.get(agent))
        if isinstance(job, Restore) and job.members:  # a sharded trainer: its ranks rebuild it together
            self.finished_steps.pop(agent, None)
            state = self.states.at(agent, job.version)
            if state is None:
                return snapshots.restore_trainer, (key, *trainer, None, 0, options, self._group(job))
            return replay.rebuild_trainer, (state, self._replay_base(job), self._group(job))
        if isinstance(job, Restore):
            self.finished_steps.pop(agent, None)  # the rebuilt trainer redoes the step: its ranks' results too
            state = self.states.at(agent, job.version)
            return (replay.restore_at, (state,)) if state else (snapshots.restore_trainer, (key, *trainer, None, 0,
                                                                                            options))
        if isinstance(job, StartReplica):
            state = self.states.at(agent, job.version)
            return replay.after_snapshot, (state, replica_fns.restart_replica, key, self.model_dirs[agent],
                                           job.version, self.cfg.rollout, snapshots.weights_uri(state and state.uri),
                                           options, self.cfg.agents[agent].adapter)
        raise TypeError(f"no worker function for {job!r}")

    def _replay_base(self, job: Restore) -> int:
        """The newest whole snapshot a sharded agent's ranks rebuild ``job.version`` from: looked up once per
        formation, so that every rank replays from the same one."""
        key = (job.agent, job.formation)
        if key not in self.replay_bases:
            self.replay_bases[key] = snapshots.newest_whole_snapshot(
                self.snapshot_root, job.agent, job.version + 1, self.cfg.training.state_storage_options)
        return self.replay_bases[key]

    def _group(self, job: Finish | Restore) -> TrainerGroup | None:
        """What each rank of the job's trainer group needs to join it (None for a single slot)."""
        if not job.members:
            return None
        if self.rendezvous is None:
            self.rendezvous = Rendezvous(self.client.scheduler.address)
        name = (world_name(self.run_key, job.formation) if self.trainer_cfg[job.agent].sharded
                else f"{self.key(job.agent)}/{job.formation}")
        return TrainerGroup(name, job.members, self.rendezvous.address, self.cfg.rollout.request_timeout_s)

    def _submit(self, job: Job) -> None:
        fn, args = self._call(job)
        # a worker runs one job at a time, the kinds' priorities decide which goes first
        fut = submit_on(self.client, job.worker, timed_call, fn, *args, priority=job.kind.priority)
        self.futures[id(job)] = fut
        self.job_of[fut] = job
        if isinstance(job, Park):
            self.parks[job.agent] = fut
        rollout = self.cfg.rollout
        bound = rollout.sync_timeout_s if isinstance(job, Sync) else rollout.request_timeout_s
        self.deadlines[fut] = time.time() + bound
        fut.add_done_callback(self.finished.put)
        if self.on_submit is not None:
            self.on_submit(job.kind.label, job.agent, job.worker)

    # ------------------------------------------------------------------ events in

    def _handle(self, job: Job, timed: Timed) -> None:
        value, start, end, worker = timed.value, timed.start, timed.end, timed.worker
        swap_s = 0.0
        if isinstance(job, Train):
            swap_s = value.swap_s
            self.store_read_s += value.read_s
        if swap_s:
            self.spans.append(Span(worker, "swap", job.agent, start, start + swap_s))
        n = (len(job.requests), sum(len(r.response_ids) for r in value)) if isinstance(job, Generate) else (0, 0)
        self.spans.append(Span(worker, job.kind.span, job.agent, start + swap_s, end, requests=n[0], tokens=n[1]))
        sched = self.sched
        if isinstance(job, Generate):
            sched.done(job)
            prompts = self.prompts.pop(id(job))
            for request, prompt_ids, res in zip(job.requests, prompts, value, strict=True):
                self.collector.tokens += len(res.response_ids)
                self.collector.generated += 1
                sched.node_done(request, self.collector.record(request, prompt_ids, res))
            return
        if isinstance(job, Finish):
            self.finished_steps.setdefault(job.agent, []).append(value)
        elif isinstance(job, Sync) and value.version != job.version:
            raise WeightSyncError(f"replica {job.worker} of agent {job.agent!r} reports v{value.version} after a sync "
                                  f"to v{job.version}")
        elif isinstance(job, MoveState):
            self.parks.pop(job.agent, None)
            resumed: StateResumed = value
            if resumed.prefetch is not None:
                self.spans.append(Span(job.worker, "swap", job.agent, resumed.prefetch.start, resumed.prefetch.end,
                                       background=True))
            prefetch_s = resumed.prefetch.end - resumed.prefetch.start if resumed.prefetch is not None else 0.0
            self.state_moves.append(StateMove(job.agent, job.worker, resumed.load_s, resumed.prefetch is not None,
                                              prefetch_s))
            self._notify(self.state_moves[-1])
        if sched.done(job, value, seconds=end - start) and isinstance(job, Sync):
            last = sched.training.pending_syncs[job.agent] == 0
            fetch = self.weights.get(job.agent)
            if last and fetch is not None and fetch.version == job.version:
                del self.weights[job.agent]  # lets Dask free the fetched copies: a 135M model's are 651 MB each
            self.syncs.append(WeightSynced(job.agent, job.version, job.worker, end - start, value.nbytes, last,
                                           in_place=job.in_place))
            self._notify(self.syncs[-1])
        if job.kind in (JobKind.RESTORE, JobKind.START_REPLICA, JobKind.CATCH_UP):
            sched.recovery.check_recovered(time.time())

    def _record_update(self, agent: str, step: int) -> None:
        result = UpdateResult.of_ranks(self.finished_steps.pop(agent))
        batches = self.sched.training.micro[(agent, step)]
        mean_reward, staleness, dropped = self.collector.update_stats(agent, step)
        metrics = {**result.metrics, "groups/dropped_zero_variance": float(dropped)}
        # The consumption record and the version bump are one commit. A skipped (NaN) or empty update is
        # recorded too, consuming nothing, so that versions stay contiguous.
        with self.collector.timing_store():
            self.store.record_update(
                agent, result.policy_version, result.consumed_ids,
                samples_version=max(m.stored.version for m in batches), num_tokens=result.num_tokens,
                metrics={**metrics, "skipped": float(result.skipped)},
            )
        now = time.time() - self.t0
        event = UpdateEvent(agent, step, result.policy_version, len(result.consumed_ids), result.num_tokens,
                            mean_reward, metrics, now, result.skipped, staleness,
                            len(self.sched.rollout.waiting[agent]), max(now - self.driver_wait_s, 0.0))
        self.updates.append(event)
        self.sched.updated(agent, step, result.policy_version)
        if self.snapshot_root is not None:  # keep the newest scheduled state before this version, and later ones
            every = self.cfg.run.snapshot_every
            snapshots.prune_snapshots(self.snapshot_root, agent, (result.policy_version - 1) // every * every,
                                      self.cfg.training.state_storage_options)
        self._notify(event)
