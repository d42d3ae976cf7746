"""The Dask executor: carries out the scheduler's commands on a cluster and reports what finished.

One event loop in the driver keeps every worker fed. The scheduler (``scheduler.py``) decides what runs when;
this module only submits its tasks to the workers they are pinned to, turns finished futures into the
scheduler's events, keeps deadlines, and leaves episodes and store commits to the collector
(``collector.py``). It records a timeline of every worker's busy time.

Faults: every ``train.snapshot_every`` updates the agent's training state is copied before the update is
recorded and written as a snapshot in the background (``training/snapshots.py``); a recovery task that needs a
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
from itertools import chain
from pathlib import Path
from typing import Protocol

from distributed import Client, Future, fire_and_forget
from distributed import TimeoutError as DaskTimeoutError

from flexmarl.cluster.local import scheduler_workers, submit_on
from flexmarl.cluster.worker_state import timed_call
from flexmarl.config import RunConfig
from flexmarl.orchestrator.collector import Collector
from flexmarl.orchestrator.policy import SchedulePolicy
from flexmarl.orchestrator.records import (
    AgentFailed, PipelineEvent, PipelineResult, Span, StateMove, StepOpened, UpdateEvent, WeightSynced,
)
from flexmarl.orchestrator.scheduler import AgentShape, Scheduler
from flexmarl.orchestrator.supervisor import Supervisor
from flexmarl.orchestrator.tasks import (
    Cancel, CatchUp, Commit, Discard, Finish, Generate, GroupDone, Park, Prefetch, RecordUpdate, Replay, Restore,
    Resume, Snapshot, StartReplica, StepDone, Sync, Task, TaskKind, Train, overdue,
)
from flexmarl.rollout import replica as replica_fns
from flexmarl.rollout.backend import GenerationRequest, WeightSyncError
from flexmarl.rollout.balancer import InterAgentBalancer
from flexmarl.rollout.episodes import EpisodeGraph, request_seed
from flexmarl.training import replay, slot, snapshots
from flexmarl.workloads.datasets import TaskStream
from storage.store import ExperienceStore

RESULT_WAIT_S = 30.0  # fetching a finished task's value; longer means the worker holding it died meanwhile


class PipelineStopped(RuntimeError):
    """The pipeline was asked to stop (its ``stop_requested`` was set); the run can be resumed from its store."""


class StopFlag(Protocol):
    """What the loop asks on each turn: a ``threading.Event``, or a run's ``channel.StopSignal``."""

    def is_set(self) -> bool: ...


def build_scheduler(cfg: RunConfig, policy: SchedulePolicy, *, rollout_slots, engines, slots, location, versions,
                    train: bool = True, snapshot_every: int = 0) -> Scheduler:
    """The run's scheduler, from its config (the simulator builds its own from a preset)."""
    shapes = {}
    for agent, spec in cfg.agents.items():
        trainer = cfg.trainer_config(agent)
        shapes[agent] = AgentShape(trainer.micro_batch_size, spec.sampling.max_new_tokens,
                                   cfg.rollout.max_batch_size, trainer.advantage == "agent")
    balancer = InterAgentBalancer(
        cfg.rollout.balance_threshold, cfg.rollout.balance_cooldown_s,
        min_slots=1 if len(rollout_slots) >= len(cfg.agents) else 0, lanes=cfg.cluster.threads_per_worker,
    ) if cfg.rollout.load_balance else None
    return Scheduler(policy=policy, graph=cfg.graph.expanded, agents=shapes,
                     queries_per_step=cfg.train.queries_per_step, group_size=cfg.train.group_size,
                     rollout_slots=rollout_slots, engines=engines, slots=slots, location=location,
                     versions=versions, balancer=balancer, train=train, snapshot_every=snapshot_every)


class PipelineRunner:
    """Runs ``cfg.train.steps`` updates of every agent under ``policy``.

    Args:
        client: Dask client of the cluster that holds the engines.
        cfg: the run's config.
        store: the run's experience store (this runner is the only writer of its sample tables).
        run_key: prefix of the engines' registry keys on the workers.
        tokenizers: per agent, for prompts and decoding on the driver.
        engines: per agent, the workers holding its rollout engine (each gets the agent's weight syncs).
        rollout_slots: the replica slots, as (worker, agent it serves first); the worker must hold an engine
            of every agent a slot may move to (all of them, when ``rollout.load_balance`` is on).
        trainers: per agent, the worker holding its trainer at the start.
        slots: the training workers; agents bind them on demand.
        model_dirs: per agent, its model directory (to rebuild a trainer on another slot).
        state_uri: a directory or fsspec URI where training states are parked when they move between workers.
        versions: per agent, the starting policy version.
        tasks: the task stream.
        on_event: called in the loop's thread with what happens as it happens (``records.PipelineEvent``: steps
            opened, micro-batches committed, updates recorded, weights synced, slots and states moved,
            recoveries, and the agent whose task is about to fail the run).
        train: False samples and commits the steps' episodes without training (the rollout benchmark).
        snapshot_root: where each agent's training state is written every ``train.snapshot_every`` updates (a
            directory or URI under ``training.state_uri``); None writes none, and then a lost trainer past
            version 0 cannot be rebuilt.
        on_submit: called with (kind, agent, worker) after each task is submitted (fault injection in tests
            and ``flexmarl bench chaos``).
    """

    def __init__(
        self, *, client: Client, cfg: RunConfig, policy: SchedulePolicy, store: ExperienceStore, run_key: str,
        tokenizers: dict, engines: dict[str, list[str]], rollout_slots: list[tuple[str, str]],
        trainers: dict[str, str], slots: list[str], model_dirs: dict[str, str], state_uri: str | Path,
        versions: dict[str, int], tasks: TaskStream, on_event: Callable[[PipelineEvent], None] | None = None,
        train: bool = True, snapshot_root: str | None = None, on_submit: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.client, self.cfg, self.store = client, cfg, store
        self.run_key, self.on_event, self.on_submit = run_key, on_event, on_submit
        self.model_dirs, self.snapshot_root = model_dirs, snapshot_root
        self.state_uri = str(state_uri).rstrip("/")
        self.sched = build_scheduler(cfg, policy, rollout_slots=rollout_slots, engines=engines, slots=slots,
                                     location=trainers, versions=versions, train=train,
                                     snapshot_every=cfg.train.snapshot_every if snapshot_root is not None else 0)
        self.graph = EpisodeGraph(cfg, tokenizers)
        self.collector = Collector(cfg, store, self.graph, tasks)
        self.trainer_cfg = {a: cfg.trainer_config(a) for a in cfg.agents}
        self.states = replay.StateSources(snapshot_root, {a: replay.StateSource(  # version set where needed
            self.key(a), model_dirs[a], self.trainer_cfg[a], cfg.agents[a].sampling.temperature,
            cfg.agents[a].sampling.max_new_tokens, snapshot_root or "", 0, store.spec,
            cfg.training.state_storage_options) for a in cfg.agents})
        self.timeout_s = cfg.rollout.request_timeout_s
        self.futures: dict[int, Future] = {}  # id(task) -> its future
        self.task_of: dict[Future, Task] = {}
        self.deadlines: dict[Future, float] = {}  # every submitted task's: a frozen worker is found by any of them
        self.prompts: dict[int, list[list[int]]] = {}  # id(generate task) -> its prompts
        self.parks: dict[str, Future] = {}  # agent -> the task writing its state
        self.prefetches: dict[str, Future] = {}  # agent -> the task reading its state ahead
        self.weights: dict[str, tuple[int, Future]] = {}  # agent -> (version, the fetch of its new weights)
        self.finished_steps: dict[str, object] = {}  # agent -> its last optimizer step's result
        self.finished: queue.Queue[Future | None] = queue.Queue()  # None: a group was scored
        self.spans: list[Span] = []
        self.updates: list[UpdateEvent] = []
        self.state_moves: list[StateMove] = []
        self.store_read_s = self.driver_wait_s = 0.0
        self.stop_requested: StopFlag = threading.Event()
        self.told = {"moves": 0, "recoveries": 0, "recovered": 0}  # how many of each list `on_event` has seen

    @property
    def versions(self) -> dict[str, int]:
        return self.sched.versions

    @property
    def location(self) -> dict[str, str]:
        return self.sched.location

    def key(self, agent: str) -> str:
        return f"{self.run_key}/{agent}"

    # ------------------------------------------------------------------ the loop

    def run(self) -> PipelineResult:
        self.t0 = self.last_progress = time.time()
        self.collector.open(self.sched.next_step)
        self.supervisor = Supervisor(self.client, self.cfg, self.sched.recovery)
        sched, target = self.sched, self.cfg.train.steps
        while True:
            if self.stop_requested.is_set():
                self.client.cancel(list(self.task_of))
                raise PipelineStopped(f"the pipeline was stopped at versions {self.versions}; resume it from the store")
            self._carry_out(self.collector.gate.released())  # here only: what they free is dispatched below
            while (step := sched.admissible()) is not None:
                self.collector.open_step(sched, step)
                self._notify(StepOpened(step, tuple(a for a, v in self.versions.items() if self.sched.train and v <= step)))
                self._carry_out()
            sched.dispatch(time.time() - self.t0)
            self._carry_out()
            self._notify_lists()
            if not sched.inflight and not sched.recovery.waiting and not self.collector.gate.pending:
                if sched.is_finished(target):
                    break
                raise RuntimeError(f"pipeline stalled with nothing in flight (versions {self.versions})")
            fut = self._next_finished()
            if fut is None or fut not in self.task_of:  # the supervisor acted, or the task was given up
                continue
            try:
                value = fut.result(timeout=RESULT_WAIT_S)  # re-raises a task's error here, in the driver
            except (TimeoutError, DaskTimeoutError):
                self.supervisor.poll(force=True)  # the worker holding the value died: its work is redone
                self._carry_out()  # the recovery's commands forget the lost worker's tasks, this one among them
                if fut in self.task_of:  # it holds the value but does not answer (frozen): a hung worker
                    task = self.task_of[fut]
                    self._restart_hung(task, f"the value of finished task {task.kind.label} {task.agent!r} cannot "
                                             f"be fetched from {task.worker} within {RESULT_WAIT_S:.0f}s", TimeoutError)
                continue
            except Exception:
                with self._blame(self.task_of[fut]):  # the task's own error fails the run
                    raise
            self.last_progress = time.time()
            task = self.task_of[fut]
            self.supervisor.proven.add(task.worker)
            self._forget(task)
            with self._blame(task):
                self._handle(task, value)
        workers = sorted(scheduler_workers(self.client))
        c = self.collector
        return PipelineResult(self.t0, time.time() - self.t0, self.spans, self.updates, workers, c.tokens,
                              c.store_write_s, self.store_read_s,
                              sched.balancer.moves if sched.balancer else [], sched.queue_trace, self.state_moves,
                              c.generated, c.reused, sched.recovery.recoveries,
                              max(time.time() - self.t0 - self.driver_wait_s, 0.0))

    # ------------------------------------------------------------------ what the caller is told

    def _notify(self, event: PipelineEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _notify_lists(self) -> None:
        """Tell the balancer's slot moves and the recoveries (opened and closed) not told yet."""
        moves = self.sched.balancer.moves if self.sched.balancer else []
        recoveries = self.sched.recovery.recoveries
        recovered = [r for r in recoveries if r.recovered_at is not None]
        for event in [*moves[self.told["moves"]:], *recoveries[self.told["recoveries"]:],
                      *recovered[self.told["recovered"]:]]:
            self._notify(event)
        self.told = {"moves": len(moves), "recoveries": len(recoveries), "recovered": len(recovered)}

    @contextmanager
    def _blame(self, task: Task) -> Iterator[None]:
        """An error raised while finishing ``task`` fails the run: tell whose task it was, then let it go on."""
        try:
            yield
        except PipelineStopped:
            raise
        except Exception as exc:
            self._notify(AgentFailed(task.agent, f"{type(exc).__name__}: {exc}"))
            raise

    def _forget(self, task: Task) -> Future | None:
        fut = self.futures.pop(id(task), None)
        if fut is not None:
            self.task_of.pop(fut, None)
            self.deadlines.pop(fut, None)
        return fut

    def _next_finished(self) -> Future | None:
        """The next finished task, or None when the supervisor acted on a lost or hung worker.

        A task past its deadline (``rollout.sync_timeout_s`` for a weight sync, ``rollout.request_timeout_s``
        for the rest) counts as a hung worker, which the supervisor replaces (or, on a worker without a
        nanny, fails fast naming it). With no task in flight, nothing finishing within
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
                task = self.task_of[late[0]]
                self._restart_hung(task, overdue(task, self.cfg.rollout.sync_timeout_s,
                                                 self.cfg.rollout.request_timeout_s),
                                   WeightSyncError if isinstance(task, Sync) else TimeoutError)
                return None
            if now >= self.last_progress + self.timeout_s and not self.deadlines and not self.sched.recovery.waiting:
                what = sorted({f"{t.kind.label} {t.agent}" for t in self.sched.inflight})
                raise TimeoutError(f"nothing finished within {self.timeout_s:.0f}s; waiting on {what}")

    def _restart_hung(self, task: Task, why: str, error: type[Exception]) -> None:
        """Have the supervisor replace ``task``'s hung worker (raising ``error``, blamed on its agent, where it
        cannot); the wait for progress starts again."""
        with self._blame(task):
            self.supervisor.restart({task.worker}, why, error)
        self.last_progress = time.time()

    # ------------------------------------------------------------------ commands out

    def _carry_out(self, released: list[object] | tuple = ()) -> None:
        for cmd in chain(released, self.sched.drain()):  # drain: what a command adds comes too
            if self.collector.gate.held_back(cmd):  # it needs a group whose rewards are still being computed
                continue
            if isinstance(cmd, Task):
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
                    priority=TaskKind.PREFETCH.priority)
            elif isinstance(cmd, Discard):
                fn = slot.drop_trainer if cmd.trainer else slot.discard_prefetch
                if not cmd.trainer:
                    self.prefetches.pop(cmd.agent, None)
                fire_and_forget(submit_on(self.client, cmd.worker, fn, self.key(cmd.agent),
                                          priority=TaskKind.PREFETCH.priority))
            elif isinstance(cmd, Cancel):
                self.prompts.pop(id(cmd.task), None)
                fut = self._forget(cmd.task)
                if fut is not None:
                    fut.cancel()
            else:
                raise TypeError(f"unknown command {cmd!r}")

    def _park_uri(self, agent: str) -> str:
        return f"{self.state_uri}/{agent}"

    def _call(self, task: Task) -> tuple[Callable, tuple]:
        """The worker function that carries out ``task``, and its arguments."""
        key, agent, options = self.key(task.agent), task.agent, self.cfg.training.state_storage_options
        sampling = self.cfg.agents[agent].sampling
        trainer = (self.model_dirs[agent], self.trainer_cfg[agent], sampling.temperature, sampling.max_new_tokens)
        if isinstance(task, Generate):
            requests = [GenerationRequest(r.sample_id, self.graph.prompt(self.collector.episode(r), r.node),
                                          sampling.max_new_tokens, sampling.temperature,
                                          request_seed(self.cfg.train.seed, r.sample_id)) for r in task.requests]
            self.prompts[id(task)] = [r.prompt_ids for r in requests]
            return replica_fns.generate, (key, requests)
        if isinstance(task, Train):
            version, ids = task.batch.data
            return slot.accumulate, (key, self.store.spec, version, ids, task.batch.step)
        if isinstance(task, Finish):
            return slot.finish_step, (key,)
        if isinstance(task, Snapshot):
            version = self.finished_steps[agent].policy_version
            return snapshots.save_snapshot, (key, self.snapshot_root, version, options, task.background)
        if isinstance(task, Sync) and task.source is not None:
            if self.weights.get(agent, (None,))[0] != task.version:  # one fetch for all the agent's engines
                self.weights[agent] = (task.version, submit_on(self.client, task.source, slot.weights, key))
            return replica_fns.load_weights, (key, task.version, self.weights[agent][1])
        if isinstance(task, (Sync, CatchUp)):  # the trainer that made the version is gone, or an engine is late
            state = self.states.at(agent, task.version)
            return replay.after_snapshot, (state, replica_fns.load_weights_from, key, task.version,
                                           snapshots.weights_uri(state.uri), options)
        if isinstance(task, Park):
            return slot.park, (key, self._park_uri(agent), options)
        if isinstance(task, Resume):
            after = self.prefetches.pop(agent, None) if task.prefetched else None
            return slot.resume, (key, *trainer, self._park_uri(agent), self.versions[agent],
                                 after or self.parks.get(agent))
        if isinstance(task, Restore):
            state = self.states.at(agent, task.version)
            return (replay.restore_at, (state,)) if state else (snapshots.restore_trainer, (key, *trainer, None, 0,
                                                                                             options))
        if isinstance(task, StartReplica):
            state = self.states.at(agent, task.version)
            return replay.after_snapshot, (state, replica_fns.restart_replica, key, self.model_dirs[agent],
                                           task.version, self.cfg.rollout, snapshots.weights_uri(state and state.uri),
                                           options, self.cfg.agents[agent].adapter)
        raise TypeError(f"no worker function for {task!r}")

    def _submit(self, task: Task) -> None:
        fn, args = self._call(task)
        # a worker runs one task at a time, the kinds' priorities decide which goes first
        fut = submit_on(self.client, task.worker, timed_call, fn, *args, priority=task.kind.priority)
        self.futures[id(task)] = fut
        self.task_of[fut] = task
        if isinstance(task, Park):
            self.parks[task.agent] = fut
        rollout = self.cfg.rollout
        self.deadlines[fut] = time.time() + (rollout.sync_timeout_s if isinstance(task, Sync) else rollout.request_timeout_s)
        fut.add_done_callback(self.finished.put)
        if self.on_submit is not None:
            self.on_submit(task.kind.label, task.agent, task.worker)

    # ------------------------------------------------------------------ events in

    def _handle(self, task: Task, result: tuple) -> None:
        value, start, end, worker = result
        swap_s = value.get("swap_s", 0.0) if isinstance(task, Train) else 0.0
        self.store_read_s += value.get("read_s", 0.0) if isinstance(task, Train) else 0.0
        if swap_s:
            self.spans.append(Span(worker, "swap", task.agent, start, start + swap_s))
        n = (len(task.requests), sum(len(r.response_ids) for r in value)) if isinstance(task, Generate) else (0, 0)
        self.spans.append(Span(worker, task.kind.span, task.agent, start + swap_s, end, requests=n[0], tokens=n[1]))
        sched = self.sched
        if isinstance(task, Generate):
            sched.done(task)
            prompts = self.prompts.pop(id(task))
            for request, prompt_ids, res in zip(task.requests, prompts, value, strict=True):
                self.collector.tokens += len(res.response_ids)
                self.collector.generated += 1
                sched.node_done(request, self.collector.record(request, prompt_ids, res))
            return
        if isinstance(task, Finish):
            self.finished_steps[task.agent] = value
        elif isinstance(task, Sync) and value != task.version:
            raise WeightSyncError(f"replica {task.worker} of agent {task.agent!r} reports v{value} after a sync "
                                  f"to v{task.version}")
        elif isinstance(task, Resume):
            self.parks.pop(task.agent, None)
            prefetch_s = 0.0
            if value["prefetch"] is not None:
                p_start, p_end = value["prefetch"]
                prefetch_s = p_end - p_start
                self.spans.append(Span(task.worker, "swap", task.agent, p_start, p_end, background=True))
            self.state_moves.append(StateMove(task.agent, task.worker, value["load_s"], value["prefetch"] is not None,
                                              prefetch_s))
            self._notify(self.state_moves[-1])
        if sched.done(task, value) and isinstance(task, Sync):
            last = sched.pending_syncs[task.agent] == 0
            if last and self.weights.get(task.agent, (None,))[0] == task.version:
                del self.weights[task.agent]  # lets Dask free the fetched copies: a 135M model's are 651 MB each
            self._notify(WeightSynced(task.agent, task.version, task.worker, end - start, last))
        if task.kind in (TaskKind.RESTORE, TaskKind.START_REPLICA, TaskKind.CATCH_UP):
            sched.recovery.check_recovered(time.time())

    def _record_update(self, agent: str, step: int) -> None:
        result = self.finished_steps.pop(agent)
        batches = self.sched.micro[(agent, step)]
        mean_reward, staleness, dropped = self.collector.update_stats(agent, step)
        metrics = {**result.metrics, "groups/dropped_zero_variance": float(dropped)}
        # The consumption record and the version bump are one commit. A skipped (NaN) or empty update is
        # recorded too, consuming nothing, so that versions stay contiguous.
        with self.collector._timing_store():
            self.store.record_update(
                agent, result.policy_version, result.consumed_ids,
                samples_version=max(m.data[0] for m in batches), num_tokens=result.num_tokens,
                metrics={**metrics, "skipped": float(result.skipped)},
            )
        now = time.time() - self.t0
        event = UpdateEvent(agent, step, result.policy_version, len(result.consumed_ids), result.num_tokens,
                            mean_reward, metrics, now, result.skipped, staleness, len(self.sched.waiting[agent]),
                            max(now - self.driver_wait_s, 0.0))
        self.updates.append(event)
        self.sched.updated(agent, step, result.policy_version)
        if self.snapshot_root is not None:  # keep the newest scheduled state before this version, and later ones
            every = self.cfg.train.snapshot_every
            snapshots.prune_snapshots(self.snapshot_root, agent, (result.policy_version - 1) // every * every,
                                      self.cfg.training.state_storage_options)
        self._notify(event)
