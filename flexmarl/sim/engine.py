"""The simulated-clock executor: the pipeline's own scheduler, driven by a cost model and an event heap.

``Simulation`` drives the same ``Scheduler`` (``flexmarl/orchestrator/scheduler.py``) as the Dask runtime:
every decision (admission, request batching, replicas and the inter-agent balancer, the micro-batch
partition and its commits, training-slot binding, prefetches, moves and weight syncs) is the runtime's own
code, so a change there changes the simulation. This module only decides how long things take and when they
finish: a worker (a device group) runs its jobs highest priority first, ``lanes`` at a time (a Dask worker:
one; a continuous-batching rollout engine: one per replica); each job's duration comes from the cost
model (``costmodel.py``): a generation batch from the decode curve and the sampled response lengths, a
micro-batch from its tokens, a swap, move, join or prefetch from the state size, a sync from the model's sync
time. A trainer group's optimizer step (one ``Finish`` per rank) is a collective: each rank holds its worker
from its start, and every rank ends together, when the last one has stepped and the gradients are all-reduced.
Nothing is tokenised, generated or trained.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from flexmarl.orchestrator.commands import (
    Commit, Discard, Finish, Generate, GroupDone, Job, JobKind, Join, MoveState, Park, Prefetch, RecordUpdate,
    Request, StepDone, Sync, Train,
)
from flexmarl.orchestrator.policy import AgentShape, SchedulePolicy, deal_replicas
from flexmarl.orchestrator.prices import ring_share
from flexmarl.orchestrator.scheduler import Scheduler
from flexmarl.rollout.balancer import InterAgentBalancer
from flexmarl.sim.costmodel import Layout, SimPreset
from flexmarl.sim.result import MODES, SPAN_KINDS, SimMode, SimResult, UpdateRecord, Worker

__all__ = ["MODES", "SPAN_KINDS", "SimMode", "SimResult", "Simulation", "UpdateRecord", "Worker", "simulate"]


@dataclass
class Running:
    """A scheduler job on the simulated clock."""

    job: Job
    # known at submission for generate, train, finish and sync (a group's finish: once its last rank starts); at
    # start for the others
    duration: float = 0.0
    start: float = 0.0
    swap_s: float = 0.0  # the part spent bringing the agent's state onto the devices
    ends: np.ndarray | None = None  # continuous batching: when each request's sequence ends, from the start
    generated: int = 0  # response tokens a generation batch produces

    @property
    def agent(self) -> str:
        return self.job.agent

    @property
    def kind(self) -> JobKind:
        return self.job.kind


class Simulation:
    """One simulated run of ``preset`` under ``mode`` (a key of ``MODES``).

    Args:
        preset: the cluster, cost model, agents, graph and workload.
        mode: the schedule.
        steps: optimizer steps per agent (default: the preset's).
        policy: the schedule policy (default: built from the mode, as ``runtime.schedule_policy`` does).
        memo: the scheduler's memos (``Scheduler(memo=...)``); off, it asks every question afresh.
    """

    def __init__(self, preset: SimPreset, mode: str, *, steps: int | None = None,
                 policy: SchedulePolicy | None = None, memo: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.preset, self.mode_name, m = preset, mode, MODES[mode]
        wl = self.wl = preset.workload
        self.steps_target = steps or wl.steps
        self.agents = list(preset.agents)
        self.agent_index = {a: i for i, a in enumerate(self.agents)}
        policy = policy or SchedulePolicy(
            mode=m.mode, steps=self.steps_target, pipeline=m.pipeline,
            max_staleness={a: m.max_staleness for a in self.agents},
            micro_batch_generation=wl.micro_batch_generation if m.micro_batch_generation is None
            else m.micro_batch_generation,
        )
        layout: Layout = (preset.cluster.sync_layout if m.baseline_layout and preset.cluster.sync_layout
                          else preset.cluster.layout)
        self.layout = layout

        # ---- workers: rollout workers, and training slots (the same workers when colocated)
        self.workers: list[Worker] = []
        rollout_names = []
        lanes = wl.replicas_per_worker if wl.batching == "continuous" else 1
        for i in range(layout.workers):
            w = Worker(f"{'worker' if layout.colocated else 'rollout'}-{i:04d}", layout.devices_per_worker,
                       "both" if layout.colocated else "rollout", lanes)
            self.workers.append(w)
            rollout_names.append(w.name)
        if layout.colocated:
            slot_names = list(rollout_names)
        else:
            slot_names = []
            for i in range(layout.training_slots):
                w = Worker(f"train-{i:04d}", layout.devices_per_slot, "train")
                self.workers.append(w)
                slot_names.append(w.name)
        self.worker = {w.name: w for w in self.workers}
        self.worker_index = {w.name: i for i, w in enumerate(self.workers)}
        slots = sorted(slot_names)

        # ---- the scheduler, placed as the runtime places: replicas dealt round-robin, engines of every agent
        # everywhere when balancing, agents on the training slots round-robin (``place``)
        replicas = deal_replicas(self.agents, rollout_names, wl.replicas_per_worker)
        engines = {a: list(rollout_names) if m.load_balance else sorted({w for w, x in replicas if x == a})
                   for a in self.agents}
        self.subreplicas = {  # data-parallel replicas of the agent's model on one rollout worker
            a: layout.devices_per_worker // preset.model_of(a).rollout_devices for a in self.agents
        }
        # one replica's batch is split over the worker's data-parallel copies, so it may be that many times larger
        shapes = {a: AgentShape(wl.micro_batch_size, preset.agents[a].response.max,
                                wl.max_batch_size * max(1, self.subreplicas[a]), max_slots=m.max_slots)
                  for a in self.agents}
        balancer = InterAgentBalancer(
            wl.balance_threshold, wl.balance_cooldown_s,
            min_replicas=1 if len(replicas) >= len(self.agents) else 0, lanes=lanes,
        ) if m.load_balance else None
        self.sched = Scheduler(
            policy=policy, graph=preset.expanded, agents=shapes, queries_per_step=wl.queries_per_step,
            group_size=wl.group_size, replicas=replicas, engines=engines, slots=slots,
            location={a: slots[i % len(slots)] for i, a in enumerate(self.agents)},
            versions={a: 0 for a in self.agents}, balancer=balancer, memo=memo,
        )
        self.step_table = {a: preset.model_of(a).step_seconds(np.arange(1, wl.max_batch_size + 1, dtype=float))
                           for a in self.agents}

        self.now = 0.0
        self.events: list = []  # heap of (time, seq, kind, payload)
        self.seq = 0
        self.lengths: dict[int, dict[str, np.ndarray]] = {}  # step -> node -> response length per episode
        self.prompts: dict[int, dict[str, np.ndarray]] = {}  # step -> node -> prompt length (set at dispatch)
        self.cost: dict[int, tuple[int, int]] = {}  # id(micro-batch) -> (samples, tokens the trainer processes)
        self.held: dict[str, list[Running]] = {}  # agent -> state moves and joins waiting for its state's park
        self.collectives: dict[tuple[str, int], list[Running]] = {}  # (agent, step) -> its group's ranks started
        self.prefetch: dict[str, tuple[str, float | None]] = {}  # agent -> (slot, when its read ends; None: not begun)
        self.updates: list[UpdateRecord] = []
        self.tokens = 0
        self.n_events = 0
        self._spans: tuple[list, list, list, list, list] = ([], [], [], [], [])

    # the scheduler's state, for inspection
    nodes_of = property(lambda self: self.sched.nodes_of)
    agent_of = property(lambda self: self.sched.agent_of)
    order = property(lambda self: self.sched.order)
    waiting = property(lambda self: self.sched.rollout.waiting)
    micro = property(lambda self: self.sched.training.micro)
    versions = property(lambda self: self.sched.versions)
    replicas = property(lambda self: self.sched.rollout.replicas)

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        sched, target = self.sched, self.steps_target
        while True:
            while (step := sched.admissible()) is not None:
                self._open(step)
                self._carry_out()
            sched.dispatch(self.now)
            self._carry_out()
            if not self.events:
                if sched.is_finished(target):
                    break
                raise RuntimeError(f"simulation stalled with nothing in flight (versions {self.versions})")
            self._next_event()
            self._carry_out()
        w, k, a, s, e = self._spans
        return SimResult(
            self.mode_name, self.now, target, self.workers, np.array(w, dtype=np.int32),
            np.array(k, dtype=np.int8), np.array(a, dtype=np.int16), np.array(s), np.array(e), self.agents,
            self.updates, self.tokens, list(balancer.moves) if (balancer := sched.rollout.balancer) else [],
            self.n_events,
        )

    def _open(self, step: int) -> None:
        wl = self.wl
        rng = np.random.default_rng([wl.seed, step])  # the same draws in every mode
        n = wl.queries_per_step * wl.group_size
        order = self.sched.order
        self.lengths[step] = {node: self.preset.agents[self.sched.agent_of[node]].response.sample(rng, n)
                              for node in order}
        self.prompts[step] = {node: np.zeros(n, dtype=np.int64) for node in order}
        # the runtime's input ids, so that requests sort (and batch) as there
        self.sched.open_step(step, [f"s{step}q{q}" for q in range(wl.queries_per_step)])
        self.sched.start_step(step)

    def _push(self, at: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def _next_event(self) -> None:
        at, _, kind, payload = heapq.heappop(self.events)
        self.now = at
        self.n_events += 1
        if kind == "commit":
            self.sched.committed(payload, self.now)
        elif kind == "part":  # streamed results of a continuous batch: its sequences that just ended
            for request in payload:
                self.sched.node_done(request)
        else:
            worker, running = payload
            worker.running.remove(running)
            self._record_span(worker, running)
            self._start_next(worker)  # the worker takes its next job before the driver hears of this one
            self._finished(running)

    # ------------------------------------------------------------------ commands

    def _carry_out(self) -> None:
        sched = self.sched
        for cmd in sched.drain():
            if isinstance(cmd, Job):
                self._submit(cmd)
            elif isinstance(cmd, Commit):
                self._commit(cmd)
            elif isinstance(cmd, RecordUpdate):
                batches = sched.updated(cmd.agent, cmd.step, cmd.step + 1)
                costs = [self.cost.pop(id(m)) for m in batches]
                self.updates.append(UpdateRecord(cmd.agent, cmd.step, self.now, sum(c[0] for c in costs),
                                                 sum(c[1] for c in costs)))
            elif isinstance(cmd, Prefetch):  # a background read, after the park (if one is under way)
                parking = sched.inflight.of(cmd.agent, JobKind.PARK) or cmd.agent in self.held
                self.prefetch[cmd.agent] = (cmd.worker, None if parking else self.now + self._move_s(cmd.agent))
            elif isinstance(cmd, Discard):
                if not cmd.trainer and self.prefetch.get(cmd.agent, (None,))[0] == cmd.worker:
                    del self.prefetch[cmd.agent]
            elif isinstance(cmd, StepDone):
                del self.lengths[cmd.step], self.prompts[cmd.step]
            elif not isinstance(cmd, GroupDone):  # scoring costs nothing here; nothing else is ever decided
                raise TypeError(f"the simulator cannot carry out {cmd!r}")

    def _commit(self, cmd: Commit) -> None:
        g = self.wl.group_size
        drawn, prompts = self.lengths[cmd.step], self.prompts[cmd.step]
        for mb in cmd.batches:
            episodes = np.concatenate([np.arange(q * g, (q + 1) * g) for q in sorted(mb.queries)])
            nodes = self.sched.nodes_of[mb.agent]
            tokens = int(sum(drawn[n][episodes].sum() + prompts[n][episodes].sum() for n in nodes))
            self.cost[id(mb)] = (len(episodes) * len(nodes), tokens)
            if self.preset.driver.commit_s:
                self._push(self.now + self.preset.driver.commit_s, "commit", mb)
            else:
                self.sched.committed(mb, self.now)

    def _submit(self, job: Job) -> None:
        running = Running(job)
        model = self.preset.model_of(job.agent)
        if isinstance(job, Generate):
            running.duration, running.generated, running.ends = self._generation_cost(job.agent, job.requests)
        elif isinstance(job, Train):
            samples_tokens = self.cost[id(job.batch)][1]
            running.duration = samples_tokens / (model.train_tokens_per_s * self.worker[job.worker].devices) + (
                model.train_overhead_s)
        elif isinstance(job, Finish):
            running.duration = model.optimizer_step_s + self._all_reduce_s(job.agent, len(job.members))
        elif isinstance(job, Sync):
            running.duration = model.weight_sync_s
        elif isinstance(job, (MoveState, Join)) and self.sched.inflight.of(job.agent, JobKind.PARK):
            # resumed once its park is written (Dask waits on the park's future)
            self.held.setdefault(job.agent, []).append(running)
            return
        self._queue(running)

    def _queue(self, running: Running) -> None:
        worker = self.worker[running.job.worker]
        self.seq += 1
        heapq.heappush(worker.queue, (-running.kind.priority, self.seq, running))
        self._start_next(worker)

    def _start_next(self, worker: Worker) -> None:
        overhead = self.preset.driver.task_overhead_s
        while worker.queue and len(worker.running) < worker.lanes:
            _, _, running = heapq.heappop(worker.queue)
            worker.running.append(running)
            running.start = self.now
            self._price_at_start(worker, running)
            if running.ends is not None:  # streamed: each result when its sequence ends
                requests, ends = running.job.requests, running.ends
                interval = self.wl.stream_interval_s
                if interval:  # results return in chunks, at most one per interval (and the last with the batch)
                    ends = np.minimum(np.ceil(ends / interval) * interval, running.duration - running.swap_s)
                order = np.argsort(ends, kind="stable")
                cut = np.flatnonzero(np.diff(ends[order])) + 1  # one event per distinct end time
                begin = self.now + running.swap_s + overhead
                for group in np.split(order, cut):
                    self._push(begin + float(ends[group[0]]), "part", [requests[i] for i in group])
            if isinstance(running.job, Finish) and running.job.members:
                self._collective(running)
            else:
                self._push(self.now + running.duration + overhead, "done", (worker, running))

    def _collective(self, running: Running) -> None:
        """A rank of a trainer group started its part of the optimizer step; once the last rank has, every rank
        ends when the slowest would end alone (its swap, if any, the step and the all-reduce): the all-reduce
        needs every rank's gradients, and each rank holds its worker until then."""
        job = running.job
        started = self.collectives.setdefault((job.agent, job.step), [])
        started.append(running)
        if len(started) < len(job.members):
            return
        del self.collectives[(job.agent, job.step)]
        end = max(r.start + r.duration for r in started)
        for r in started:
            r.duration = end - r.start
            self._push(end + self.preset.driver.task_overhead_s, "done", (self.worker[r.job.worker], r))

    def _price_at_start(self, worker: Worker, running: Running) -> None:
        """Costs that depend on what the worker holds when the job starts: swaps of training state."""
        cluster = self.preset.cluster
        bw = cluster.swap_gb_per_s
        if running.kind is JobKind.GENERATE and worker.role == "both" and worker.resident is not None:
            # colocated: rollout needs the devices' memory, so the resident training state goes to host first
            running.swap_s = self._swap_s(worker.resident, bw)
            running.duration += running.swap_s
            worker.resident = None
        elif running.kind in (JobKind.TRAIN, JobKind.FINISH):
            if worker.resident != running.agent:
                previous = self._swap_s(worker.resident, bw) if worker.resident else 0.0
                running.swap_s = self._swap_s(running.agent, bw) + previous
                running.duration += running.swap_s
                worker.resident = running.agent
        elif running.kind is JobKind.PARK:
            running.duration = self._move_s(running.agent)
            if worker.resident == running.agent:
                worker.resident = None
        elif running.kind in (JobKind.MOVE_STATE, JobKind.JOIN):
            # a join resumes what the home parked, as a move does; its agent is bound, so nothing was read ahead
            where, ready = self.prefetch.pop(running.agent, (None, None))
            prefetched = isinstance(running.job, MoveState) and running.job.prefetched
            if prefetched and where == worker.name and ready is not None:
                # read ahead into host memory while the slot trained: only the rest of the read, then the copy
                running.duration = max(ready - self.now, 0.0) + self._swap_s(running.agent, bw)
            else:
                running.duration = self._move_s(running.agent)
            if worker.resident not in (None, running.agent):
                running.duration += self._swap_s(worker.resident, bw)
            worker.resident = running.agent

    def _swap_s(self, agent: str, bw: float | None) -> float:
        return 0.0 if bw is None else self.preset.model_of(agent).state_gb / bw

    def _move_s(self, agent: str) -> float:
        return self.preset.model_of(agent).state_gb / self.preset.cluster.move_gb_per_s

    def _all_reduce_s(self, agent: str, ranks: int) -> float:
        """Seconds of a ring all-reduce of the agent's gradients over ``ranks`` (k) slots: each sends and receives
        2 (k - 1) / k of them over its link (none for one slot)."""
        return ring_share(ranks) * self.preset.model_of(agent).gradient_gb / self.preset.cluster.link_gb_per_s

    def _record_span(self, worker: Worker, job: Running) -> None:
        w, k, a, s, e = self._spans
        wi, ai = self.worker_index[worker.name], self.agent_index[job.agent]
        start = job.start
        if job.swap_s:
            w.append(wi), k.append(2), a.append(ai), s.append(start), e.append(start + job.swap_s)
            start += job.swap_s
        w.append(wi), k.append(SPAN_KINDS.index(job.kind.span)), a.append(ai), s.append(start), e.append(self.now)

    def _finished(self, running: Running) -> None:
        job = running.job
        self.sched.done(job, seconds=running.duration)
        if isinstance(job, Generate):
            self.tokens += running.generated
            if running.ends is None:  # static batching: every result returns with the batch
                for request in job.requests:
                    self.sched.node_done(request)
        elif isinstance(job, Park):
            for held in self.held.pop(job.agent, []):
                self._queue(held)
            if job.agent in self.prefetch and self.prefetch[job.agent][1] is None:
                self.prefetch[job.agent] = (self.prefetch[job.agent][0], self.now + self._move_s(job.agent))

    def _generation_cost(self, agent: str, items: tuple[Request, ...]) -> tuple[float, int, np.ndarray | None]:
        """Seconds of one generation batch on a worker, the tokens it generates, and (continuous batching) when
        each sequence ends, in seconds from the batch's start.

        The batch is split evenly over the worker's data-parallel replicas of the model; each prefills its
        share's prompts, then decodes it. Continuous: finished sequences leave and their results return at
        once, the rest decode faster. Static: every step decodes the whole share until its longest sequence
        ends, and the results return together. The batch ends with its slowest share.
        """
        model = self.preset.model_of(agent)
        base = self.preset.agents[agent].prompt_tokens
        lengths = np.empty(len(items), dtype=np.int64)
        prompts = np.empty(len(items), dtype=np.int64)
        for i, r in enumerate(items):
            drawn = self.lengths[r.step]
            prompt = base + sum(int(drawn[p][r.episode]) for p in self.sched.parents[r.node])
            self.prompts[r.step][r.node][r.episode] = prompt
            lengths[i] = drawn[r.node][r.episode]
            prompts[i] = prompt
        table = self.step_table[agent]
        k = max(1, min(self.subreplicas[agent], len(items)))
        prefill_rate = model.prefill_tokens_per_s * model.rollout_devices
        if self.wl.batching == "static":
            slowest = max(float(lengths[r::k].max() * table[len(lengths[r::k]) - 1])
                          + float(prompts[r::k].sum()) / prefill_rate for r in range(k))
            return slowest, int(lengths.sum()), None
        ends = np.empty(len(items))
        for r in range(k):
            idx = np.arange(r, len(items), k)
            order = idx[np.argsort(lengths[idx], kind="stable")]
            share = lengths[order]
            n = len(share)
            # segment j (between the j-th and j+1-th shortest) decodes with n - j sequences left
            decode = np.cumsum(np.diff(share, prepend=0) * table[n - 1::-1])
            ends[order] = float(prompts[idx].sum()) / prefill_rate + decode
        return float(ends.max()), int(lengths.sum()), ends



def simulate(preset: SimPreset, mode: str, *, steps: int | None = None,
             policy: SchedulePolicy | None = None) -> SimResult:
    """Run one mode of ``preset`` and return its result."""
    return Simulation(preset, mode, steps=steps, policy=policy).run()
