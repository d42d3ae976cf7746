"""The micro-batch driven asynchronous pipeline: executes a ``SchedulePolicy`` on Dask.

One event loop in the driver keeps every worker fed. It submits generation batches to rollout replicas,
scores finished episodes, commits each agent's complete micro-batches to the store, submits them to the
agent's trainer, and after the last micro-batch of a global batch runs the optimizer step, records the
update and syncs the new weights to the agent's replicas. What may run when is decided by the policy; this
module only carries it out and records a timeline of every worker's busy time.
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc
from distributed import Client, Future, fire_and_forget

from flexmarl.cluster.local import submit_on
from flexmarl.cluster.worker_state import timed_call
from flexmarl.config import RunConfig
from flexmarl.orchestrator.policy import SchedulePolicy, micro_batch_of
from flexmarl.rollout import replica as replica_fns
from flexmarl.rollout.backend import GenerationRequest, WeightSyncError
from flexmarl.rollout.balancer import InterAgentBalancer, Move
from flexmarl.rollout.episodes import Episode, EpisodeGraph, request_seed
from flexmarl.rollout.scoring import episode_rows, sample_rows, scale_by_agent, score
from flexmarl.training import slot
from flexmarl.workloads.datasets import TaskStream
from storage.schema import SampleStatus
from storage.store import ExperienceStore


QUEUE_DEPTH = 2  # micro-batches of one agent queued on its slot at once
# Dask task priorities; training tasks get 0. A prefetch only starts a background read, so it goes first.
PRIORITY = {"generate": 10, "sync": 5, "park": 5, "prefetch": 20}


@dataclass(frozen=True)
class Span:
    """A stretch of work on one worker, for the timeline picture and utilisation."""

    worker: str
    kind: str  # "rollout", "train", "swap" (a training state moving) or "sync"
    agent: str
    start: float
    end: float
    background: bool = False  # off the worker's task thread (a prefetch read): overlaps its tasks, not busy time


@dataclass(frozen=True)
class UpdateEvent:
    agent: str
    step: int
    policy_version: int
    samples: int
    tokens: int
    mean_reward: float | None
    metrics: dict[str, float]
    finished_at: float  # seconds since the pipeline started
    skipped: bool = False
    staleness: float = 0.0  # mean versions between a consumed sample's generator and the weights it updated
    queue_depth: int = 0  # the agent's requests waiting for a replica when the update finished


@dataclass(frozen=True)
class StateMove:
    """An agent's training state resumed on another slot."""

    agent: str
    worker: str  # the slot it moved to
    load_s: float  # bringing the state into the new trainer, on the agent's critical path
    prefetched: bool  # the state was already in the slot's host memory (read while the slot trained)
    prefetch_s: float = 0.0  # the background read, when prefetched


@dataclass
class PipelineResult:
    start: float  # wall-clock time the pipeline started
    wall_s: float
    spans: list[Span]
    updates: list[UpdateEvent]
    workers: list[str]
    tokens: int  # response tokens generated
    store_write_s: float = 0.0  # the driver's time in store commits (samples, episodes, updates)
    store_read_s: float = 0.0  # the trainers' time reading their micro-batches from the store
    moves: list[Move] = field(default_factory=list)  # replica slots the inter-agent balancer moved
    queue_trace: list[tuple[float, str, int]] = field(default_factory=list)  # (s since start, agent, waiting)
    state_moves: list[StateMove] = field(default_factory=list)  # training states resumed on another slot

    def utilization(self) -> float:
        """Busy worker-seconds over total worker-seconds."""
        busy = sum(s.end - s.start for s in self.spans if not s.background)
        return busy / (len(self.workers) * self.wall_s) if self.wall_s > 0 else 0.0


@dataclass
class Replica:
    """A rollout replica slot: one generation batch at a time on ``worker``, for ``agent`` (slots move)."""

    agent: str
    worker: str
    busy: bool = False


@dataclass
class MicroBatch:
    agent: str
    step: int
    index: int
    queries: set[int]  # query indices whose groups it holds
    done_queries: set[int] = field(default_factory=set)
    sample_ids: list[str] = field(default_factory=list)  # rewarded samples: what the trainer consumes
    delta_version: int | None = None
    committed_at: float = 0.0
    submitted: bool = False  # sent to the trainer
    trained: bool = False

    @property
    def committed(self) -> bool:
        return self.delta_version is not None


@dataclass
class StepState:
    step: int
    episodes: list[Episode]
    groups: dict[int, list[Episode]]  # query index -> its episodes
    query_of: dict[str, int]  # input id -> query index
    done_groups: int = 0
    finished_nodes: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # layer -> count


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
        on_update: called in the loop's thread after each agent update is recorded.
        train: False samples and commits the steps' episodes without training (the rollout benchmark).
    """

    def __init__(
        self,
        *,
        client: Client,
        cfg: RunConfig,
        policy: SchedulePolicy,
        store: ExperienceStore,
        run_key: str,
        tokenizers: dict,
        engines: dict[str, list[str]],
        rollout_slots: list[tuple[str, str]],
        trainers: dict[str, str],
        slots: list[str],
        model_dirs: dict[str, str],
        state_uri: str | Path,
        versions: dict[str, int],
        tasks: TaskStream,
        on_update: Callable[[UpdateEvent], None] | None = None,
        train: bool = True,
    ) -> None:
        self.client, self.cfg, self.policy, self.store = client, cfg, policy, store
        self.run_key, self.tokenizers, self.tasks, self.on_update = run_key, tokenizers, tasks, on_update
        self.train = train
        self.slots = sorted(set(slots))
        self.location = dict(trainers)  # the worker holding each agent's trainer and state
        self.bound: dict[str, str | None] = {}  # agent -> the slot it holds for its current step
        self.model_dirs = model_dirs
        self.state_uri = str(state_uri).rstrip("/")
        self.parked: dict[str, tuple[str, Future]] = {}  # agent -> where a copy of its state is, and the park task
        self.prefetched: dict[str, tuple[str, Future]] = {}  # agent -> the slot reading its state ahead, the task
        self.state_moves: list[StateMove] = []
        self.versions = dict(versions)  # trainer versions
        self.engines = {a: list(ws) for a, ws in engines.items()}
        self.engine_version = {(a, w): versions[a] for a, ws in engines.items() for w in ws}
        self.replicas: dict[str, list[Replica]] = {a: [] for a in cfg.agents}
        for worker, agent in rollout_slots:
            self.replicas[agent].append(Replica(agent, worker))
        self.outstanding_tokens: dict[str, int] = defaultdict(int)  # per worker: tokens of batches sent to it
        self.balancer = InterAgentBalancer(
            cfg.rollout.balance_threshold, cfg.rollout.balance_cooldown_s,
            min_slots=1 if len(rollout_slots) >= len(cfg.agents) else 0,
        ) if cfg.rollout.load_balance else None
        self.queue_trace: list[tuple[float, str, int]] = []
        self.graph = EpisodeGraph(cfg, tokenizers)
        self.trainer_cfg = {a: cfg.trainer_config(a) for a in cfg.agents}
        self.nodes_in_layer: dict[int, int] = defaultdict(int)
        for node in self.graph.order:
            self.nodes_in_layer[self.graph.layer[node]] += 1
        self.timeout_s = cfg.rollout.request_timeout_s

        self.steps: dict[int, StepState] = {}
        self.next_step = min(self.versions.values())
        self.waiting: dict[str, list[tuple[int, str, Episode, str]]] = {a: [] for a in cfg.agents}
        self.micro: dict[tuple[str, int], list[MicroBatch]] = {}
        self.complete: dict[str, set[int]] = {a: set() for a in cfg.agents}
        self.queued: dict[str, int] = {a: 0 for a in cfg.agents}  # micro-batches sent to the agent's slot
        self.blocked: dict[str, bool] = {a: False for a in cfg.agents}  # optimizer step, sync or move under way
        self.pending_syncs: dict[str, int] = {a: 0 for a in cfg.agents}
        self.rewards: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.lags: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.seq = {a: self._last_seq(f"rollout:{a}", store.samples_table(a)) for a in cfg.agents}
        self.episode_seq = self._last_seq("rollout:episodes", "episodes")
        self.inflight: dict[Future, tuple] = {}
        self.sync_deadlines: dict[Future, float] = {}
        self.finished: queue.Queue[Future] = queue.Queue()
        self.spans: list[Span] = []
        self.updates: list[UpdateEvent] = []
        self.tokens = 0
        self.store_write_s = self.store_read_s = 0.0

    # ------------------------------------------------------------------ set-up helpers

    def _last_seq(self, app_id: str, table: str) -> int:
        return self.store.open(table).transaction_version(app_id) or 0

    def key(self, agent: str) -> str:
        return f"{self.run_key}/{agent}"

    # ------------------------------------------------------------------ the loop

    def run(self) -> PipelineResult:
        self.t0 = time.time()
        target = self.cfg.train.steps
        while True:
            self._admit_steps()
            self._dispatch_generation()
            self._dispatch_training()
            if not self.inflight:
                if all(v >= target for v in self.versions.values()) or (not self.train and not self.steps):
                    break
                raise RuntimeError(f"pipeline stalled with nothing in flight (versions {self.versions})")
            fut = self._next_finished()
            self.sync_deadlines.pop(fut, None)
            self._handle(fut, self.inflight.pop(fut))
        workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        return PipelineResult(self.t0, time.time() - self.t0, self.spans, self.updates, workers, self.tokens,
                              self.store_write_s, self.store_read_s,
                              self.balancer.moves if self.balancer else [], self.queue_trace, self.state_moves)

    @contextmanager
    def _timing_store(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.store_write_s += time.perf_counter() - start

    def _next_finished(self) -> Future:
        """The next finished task; fails fast on a weight sync past its deadline or a general stall."""
        deadline = time.time() + self.timeout_s
        if self.sync_deadlines:
            deadline = min(deadline, min(self.sync_deadlines.values()))
        try:
            return self.finished.get(timeout=max(deadline - time.time(), 0.0))
        except queue.Empty:
            late = [f for f, d in self.sync_deadlines.items() if d <= time.time()]
            if late:
                _, agent, worker, version = self.inflight[late[0]]
                raise WeightSyncError(
                    f"weight sync of agent {agent!r} to v{version} on replica {worker} did not finish within "
                    f"{self.cfg.rollout.sync_timeout_s:.0f}s (rollout.sync_timeout_s)"
                ) from None
            what = sorted({f"{w[0]} {w[1]}" for w in self.inflight.values()})
            raise TimeoutError(f"nothing finished within {self.timeout_s:.0f}s; waiting on {what}") from None

    def _submit(self, worker: str, fn: Callable, *args, what: tuple) -> Future:
        # A worker runs one task at a time: generation goes first, since it gates the episodes (and so
        # every agent's next batch); training and syncs fill the gaps.
        priority = PRIORITY.get(what[0], 0)
        fut = submit_on(self.client, worker, timed_call, fn, *args, priority=priority)
        self.inflight[fut] = what
        fut.add_done_callback(self.finished.put)
        return fut

    def _handle(self, fut: Future, what: tuple) -> None:
        value, start, end, worker = fut.result()  # re-raises a task's error here, in the driver
        kind = what[0]
        swap_s = value.get("swap_s", 0.0) if kind == "train" else 0.0
        self.store_read_s += value.get("read_s", 0.0) if kind == "train" else 0.0
        if swap_s:
            self.spans.append(Span(worker, "swap", what[1], start, start + swap_s))
        span_kind = {"generate": "rollout", "sync": "sync", "park": "swap", "move": "swap"}.get(kind, "train")
        self.spans.append(Span(worker, span_kind, what[1], start + swap_s, end))
        if kind == "generate":
            self._on_generated(what[2], what[3], what[4], value)
        elif kind == "train":
            self._on_trained(what[2], what[3])
        elif kind == "finish":
            self._on_step_finished(what[1], what[2], what[3], value)
        elif kind == "sync":
            self._on_synced(what[1], what[2], what[3], value)
        elif kind == "move":
            self._on_moved(what[1], what[2], value)

    # ------------------------------------------------------------------ rollout

    def _admit_steps(self) -> None:
        while self.next_step not in self.steps and self.policy.admits_step(self.next_step, self.versions):
            step = self.next_step
            tasks = self.tasks.batch(step, self.cfg.train.queries_per_step)
            groups = {q: [Episode(t, j, step) for j in range(self.cfg.train.group_size)] for q, t in enumerate(tasks)}
            state = StepState(step, [ep for g in groups.values() for ep in g], groups,
                              {t.input_id: q for q, t in enumerate(tasks)})
            self.steps[step] = state
            for agent in self.cfg.agents:
                per_query = self.cfg.train.group_size * len(self.cfg.nodes_of(agent))
                batches: dict[int, MicroBatch] = {}
                for q in groups:
                    i = micro_batch_of(q, per_query, self.trainer_cfg[agent].micro_batch_size)
                    batches.setdefault(i, MicroBatch(agent, step, i, set())).queries.add(q)
                self.micro[(agent, step)] = [batches[i] for i in sorted(batches)]
            for ep in state.episodes:
                for node in self.graph.roots:
                    self._enqueue(ep, node)
            self.next_step += 1

    def _enqueue(self, ep: Episode, node: str) -> None:
        self.waiting[self.graph.agent_of[node]].append((ep.step, self.graph.sample_id(ep, node), ep, node))

    def _layer_open(self, step: int, node: str) -> bool:
        """Layered (sync) rollout: every earlier layer of the step is done for every episode."""
        if not self.policy.layered:
            return True
        state = self.steps[step]
        n = len(state.episodes)
        return all(state.finished_nodes[k] == n * self.nodes_in_layer[k] for k in range(self.graph.layer[node]))

    def _dispatch_generation(self) -> None:
        self._balance()
        for agent, waiting in self.waiting.items():
            if not waiting:
                continue
            free = {f"{i}": r for i, r in enumerate(self.replicas[agent]) if not r.busy}
            while free and waiting:
                # intra-agent balancing: the free slot whose worker has the fewest tokens outstanding
                rep = free.pop(self.policy.pick_replica({k: self.outstanding_tokens[r.worker] for k, r in free.items()}))
                version = self.engine_version[(agent, rep.worker)]
                eligible = [
                    i for i, (step, _, _, node) in enumerate(waiting)
                    if self.policy.may_generate(agent, step, version) and self._layer_open(step, node)
                ]
                chosen = self.policy.pick_requests([waiting[i][:2] for i in eligible], self.cfg.rollout.max_batch_size)
                if not chosen:
                    continue
                items = [waiting[eligible[c]] for c in chosen]
                for c in sorted((eligible[c] for c in chosen), reverse=True):
                    del waiting[c]
                sampling = self.cfg.agents[agent].sampling
                requests = [
                    GenerationRequest(sid, self.graph.prompt(ep, node), sampling.max_new_tokens, sampling.temperature,
                                      request_seed(self.cfg.train.seed, sid))
                    for _, sid, ep, node in items
                ]
                rep.busy = True
                self.outstanding_tokens[rep.worker] += len(requests) * sampling.max_new_tokens
                self._submit(rep.worker, replica_fns.generate, self.key(agent), requests,
                             what=("generate", agent, rep, [(ep, node, r.prompt_ids) for (_, _, ep, node), r
                                                             in zip(items, requests, strict=True)],
                                   len(requests) * sampling.max_new_tokens))

    def _balance(self) -> None:
        """Record each agent's queue; inter-agent balancing moves idle replica slots to the longest queues."""
        now = time.time() - self.t0
        for agent, waiting in self.waiting.items():
            last = next((d for _, a, d in reversed(self.queue_trace) if a == agent), None)
            if last != len(waiting):
                self.queue_trace.append((now, agent, len(waiting)))
        if self.balancer is None:
            return
        while True:
            queue_depth = {a: len(w) for a, w in self.waiting.items()}
            slots = {a: len(r) for a, r in self.replicas.items()}
            idle = {a: sum(not x.busy for x in r) for a, r in self.replicas.items()}
            move = self.balancer.decide(now, queue_depth, slots, idle)
            if move is None:
                return
            # The target's engine is resident on every rollout worker: the slot switches at once. Take it where
            # the target has the fewest slots already (a second slot on a worker only queues behind the first).
            held = [r.worker for r in self.replicas[move.target]]
            rep = min((r for r in self.replicas[move.source] if not r.busy),
                      key=lambda r: (held.count(r.worker), self.outstanding_tokens[r.worker], r.worker))
            self.replicas[move.source].remove(rep)
            rep.agent = move.target
            self.replicas[move.target].append(rep)

    def _on_generated(self, rep: Replica, batch: list, tokens: int, results: list) -> None:
        rep.busy = False
        self.outstanding_tokens[rep.worker] -= tokens
        for (ep, node, prompt_ids), result in zip(batch, results, strict=True):
            self.tokens += len(result.response_ids)
            state = self.steps[ep.step]
            skipped_before = set(ep.skipped)
            ready = self.graph.record(ep, node, prompt_ids, result)
            for n in [node, *(ep.skipped - skipped_before)]:  # a skipped node counts as done for its layer
                state.finished_nodes[self.graph.layer[n]] += 1
            for child in ready:
                self._enqueue(ep, child)
            if self.graph.is_done(ep):
                self._on_episode_done(state, ep)

    def _on_episode_done(self, state: StepState, ep: Episode) -> None:
        q = state.query_of[ep.task.input_id]
        group = state.groups[q]
        if not all(self.graph.is_done(e) for e in group):
            return
        score(group, self.cfg, self.trainer_cfg)
        state.done_groups += 1
        if state.done_groups == len(state.groups):  # one episodes commit per step: training does not wait on it
            self.episode_seq += 1
            with self._timing_store():
                self.store.append_episodes(episode_rows(state.episodes), app_id="rollout:episodes",
                                           seq=self.episode_seq)
        for agent in self.cfg.agents:
            batches = self.micro[(agent, state.step)]
            mb = next(m for m in batches if q in m.queries)
            mb.done_queries.add(q)
            if self.trainer_cfg[agent].advantage != "agent":
                if mb.done_queries == mb.queries:
                    self._commit(mb, [e for qq in sorted(mb.queries) for e in state.groups[qq]])
            elif all(m.done_queries == m.queries for m in batches):
                # agent-wise normalisation needs the agent's whole batch: commit every micro-batch now
                scale_by_agent([o for ep in state.episodes for o in ep.outputs.values() if o.agent == agent],
                               eps=self.trainer_cfg[agent].adv_eps)
                for m in batches:
                    self._commit(m, [e for qq in sorted(m.queries) for e in state.groups[qq]])
        if state.done_groups == len(state.groups):
            del self.steps[state.step]  # every sample is committed: the episodes need not stay in memory

    def _commit(self, mb: MicroBatch, episodes: list[Episode]) -> None:
        rows = sample_rows(episodes, mb.agent)
        self.seq[mb.agent] += 1
        with self._timing_store():
            commit = self.store.append_samples(mb.agent, rows, app_id=f"rollout:{mb.agent}", seq=self.seq[mb.agent])
        mb.delta_version = commit.version
        mb.committed_at = time.time()
        rewarded = rows.filter(pc.field("status") == SampleStatus.REWARDED.value)
        mb.sample_ids = rewarded["sample_id"].to_pylist()
        self.rewards[(mb.agent, mb.step)] += rewarded["reward"].to_pylist()
        self.lags[(mb.agent, mb.step)] += [mb.step - v for v in rewarded["policy_version"].to_pylist()]
        if not mb.sample_ids:
            mb.submitted = mb.trained = True  # nothing to learn from (every episode failed)
        if all(m.committed for m in self.micro[(mb.agent, mb.step)]):
            self.complete[mb.agent].add(mb.step)

    # ------------------------------------------------------------------ training

    def _dispatch_training(self) -> None:
        """Agent-centric slots: an agent with training work binds a free slot and keeps it for its step.

        A bound agent's next micro-batch runs on its slot. Unbound agents with work take the free slots,
        the one whose ready work waited longest first, preferring the slot its state was prefetched to, then
        the slot that holds its state; elsewhere its state moves there first (parked by one worker, resumed
        by the other). Agents still waiting get their states prefetched to the slots likely to free next.
        """
        if not self.train:
            return
        work = {a: w for a in self.cfg.agents if (w := self._training_work(a))}
        for agent, (_, mb) in sorted(work.items()):
            bound = self.bound.get(agent)
            if bound is not None:
                self._run_training(agent, bound, mb)
        free = [w for w in self.slots if w not in self.bound.values()]
        waiting = {a: w for a, w in work.items() if self.bound.get(a) is None}
        while free and waiting:
            agent = self.policy.pick_agent({a: w[0] for a, w in waiting.items()})
            _, mb = waiting.pop(agent)
            target = self._slot_for(agent, free)
            free.remove(target)
            self.bound[agent] = target
            if target == self.location[agent]:
                self._stay(agent)
                self._run_training(agent, target, mb)
            else:
                self._move_state(agent, target)
        if waiting:
            self._prefetch_states(waiting)

    def _slot_for(self, agent: str, free: list[str]) -> str:
        prefetched_to = self.prefetched.get(agent, (None, None))[0]
        for preferred in (prefetched_to, self.location[agent]):
            if preferred in free:
                return preferred
        return free[0]

    def _slots_by_release(self) -> list[str]:
        """Bound slots, the one likely to free first first: its agent has the fewest micro-batches left."""
        left = {}
        for agent, worker in self.bound.items():
            if worker is not None:
                left[worker] = sum(not m.trained for m in self.micro.get((agent, self.versions[agent]), []))
        return sorted(left, key=lambda w: (left[w], w))

    def _prefetch_states(self, waiting: dict[str, tuple[float, MicroBatch | None]]) -> None:
        """Every slot is bound: read the states of the agents that will bind next into the host memory of the
        slots likely to free first (in the same order), while those slots train. The move then skips the read.
        """
        order, pending = [], {a: w[0] for a, w in waiting.items()}
        while pending:
            order.append(self.policy.pick_agent(pending))
            del pending[order[-1]]
        taken = {worker for worker, _ in self.prefetched.values()}
        slots = [w for w in self._slots_by_release() if w not in taken]
        for agent in order:
            if agent in self.prefetched:
                continue
            if not slots:
                break
            target = slots.pop(0)
            if target == self.location[agent]:
                continue  # its state is already there
            uri, parked = self._park(agent)
            fut = submit_on(self.client, target, slot.prefetch, self.key(agent), uri,
                            self.cfg.training.state_storage_options, parked, priority=PRIORITY["prefetch"])
            self.prefetched[agent] = (target, fut)

    def _park(self, agent: str) -> tuple[str, Future]:
        """Write the agent's state from its worker to the state store, once; returns where, and the task.

        Its trainer stays on that worker until the state is resumed elsewhere, so a wrong guess of the slot
        that frees first costs only the write when the agent then binds its own slot again.
        """
        if agent not in self.parked:
            uri = f"{self.state_uri}/{agent}"
            fut = self._submit(self.location[agent], slot.park, self.key(agent), uri,
                               self.cfg.training.state_storage_options, what=("park", agent))
            self.parked[agent] = (uri, fut)
        return self.parked[agent]

    def _stay(self, agent: str) -> None:
        """The agent binds the slot that holds its trainer: a parked copy or a read ahead is not needed."""
        self.parked.pop(agent, None)  # it trains here next, so the copy goes stale (the next park replaces it)
        prefetched = self.prefetched.pop(agent, None)
        if prefetched is not None:
            self._discard_prefetch(agent, prefetched[0])

    def _discard_prefetch(self, agent: str, worker: str) -> None:
        fire_and_forget(submit_on(self.client, worker, slot.discard_prefetch, self.key(agent),
                                  priority=PRIORITY["prefetch"]))

    def _run_training(self, agent: str, worker: str, mb: MicroBatch | None) -> None:
        step = self.versions[agent]
        if mb is not None:
            mb.submitted = True
            self.queued[agent] += 1
            self._submit(worker, slot.accumulate, self.key(agent), self.store.root, mb.delta_version,
                         mb.sample_ids, step, what=("train", agent, mb, worker))
        else:
            self.blocked[agent] = True
            self._submit(worker, slot.finish_step, self.key(agent), what=("finish", agent, step, worker))

    def _move_state(self, agent: str, target: str) -> None:
        """Resume the agent's state on ``target``: parked by its old worker (unless it already is), read by
        ``target`` (unless prefetched there); each leg is a swap span."""
        self.blocked[agent] = True
        uri, after = self._park(agent)
        prefetched = self.prefetched.pop(agent, None)
        if prefetched is not None:
            where, fut = prefetched
            if where == target:
                after = fut  # resume after the prefetch started, so that it finds the read under way
            else:  # the guess of the next free slot was wrong: free that slot's copy
                self._discard_prefetch(agent, where)
        trainer_cfg, sampling = self.trainer_cfg[agent], self.cfg.agents[agent].sampling
        self._submit(target, slot.resume, self.key(agent), self.model_dirs[agent], trainer_cfg,
                     sampling.temperature, sampling.max_new_tokens, uri, self.versions[agent], after,
                     what=("move", agent, target))

    def _on_moved(self, agent: str, target: str, value: dict) -> None:
        fire_and_forget(submit_on(self.client, self.location[agent], slot.drop_trainer, self.key(agent),
                                  priority=PRIORITY["prefetch"]))  # before any later resume of it there
        self.location[agent] = target
        self.blocked[agent] = False
        del self.parked[agent]
        prefetch_s = 0.0
        if value["prefetch"] is not None:
            start, end = value["prefetch"]
            prefetch_s = end - start
            self.spans.append(Span(target, "swap", agent, start, end, background=True))
        self.state_moves.append(StateMove(agent, target, value["load_s"], value["prefetch"] is not None, prefetch_s))

    def _training_work(self, agent: str) -> tuple[float, MicroBatch | None] | None:
        """(ready since, micro-batch to train or None for the optimizer step), or None when nothing is due.

        Up to ``QUEUE_DEPTH`` micro-batches of an agent wait on its slot, so the slot never idles while the
        driver turns a finished one around (accumulation order does not matter: gradients sum in float64).
        """
        step = self.versions[agent]  # the update to step + 1 consumes step's batch
        if self.blocked[agent] or (agent, step) not in self.micro:
            return None
        batches = self.micro[(agent, step)]
        ready = [m for m in batches if m.committed and not m.submitted]
        if ready and self.queued[agent] < QUEUE_DEPTH and self.policy.may_train(agent, step, self.complete):
            return ready[0].committed_at, ready[0]  # oldest ready data first
        if step in self.complete[agent] and all(m.trained for m in batches):
            return max(m.committed_at for m in batches), None
        return None

    def _on_trained(self, mb: MicroBatch, worker: str) -> None:
        mb.trained = True
        self.queued[mb.agent] -= 1

    def _on_step_finished(self, agent: str, step: int, worker: str, result) -> None:
        # the agent stays blocked until its replicas have the weights; its slot is free right away
        self.bound[agent] = None
        batches = self.micro.pop((agent, step))
        rewards = self.rewards.pop((agent, step), [])
        lags = self.lags.pop((agent, step), [])
        # The consumption record and the version bump are one commit. A skipped (NaN) update is recorded
        # too, consuming nothing, so that versions stay contiguous.
        with self._timing_store():
            self.store.record_update(
                agent, result.policy_version, result.consumed_ids,
                samples_version=max(m.delta_version for m in batches), num_tokens=result.num_tokens,
                metrics={**result.metrics, "skipped": float(result.skipped)},
            )
        self.versions[agent] = result.policy_version
        event = UpdateEvent(
            agent, step, result.policy_version, len(result.consumed_ids), result.num_tokens,
            sum(rewards) / len(rewards) if rewards else None, result.metrics, time.time() - self.t0, result.skipped,
            sum(lags) / len(lags) if lags else 0.0, len(self.waiting[agent]),
        )
        self.updates.append(event)
        weights = submit_on(self.client, self.location[agent], slot.weights, self.key(agent))
        for worker in self.engines[agent]:
            self.pending_syncs[agent] += 1
            fut = self._submit(worker, replica_fns.load_weights, self.key(agent), result.policy_version,
                               weights, what=("sync", agent, worker, result.policy_version))
            self.sync_deadlines[fut] = time.time() + self.cfg.rollout.sync_timeout_s
        if self.on_update is not None:
            self.on_update(event)

    def _on_synced(self, agent: str, worker: str, version: int, applied: int) -> None:
        if applied != version:
            raise WeightSyncError(f"replica {worker} of agent {agent!r} reports v{applied} after a sync to v{version}")
        self.engine_version[(agent, worker)] = version
        self.pending_syncs[agent] -= 1
        if self.pending_syncs[agent] == 0:
            self.blocked[agent] = False
