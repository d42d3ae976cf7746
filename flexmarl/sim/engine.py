"""A discrete-event simulation of the micro-batch pipeline, driving the runtime's own policy objects.

``Simulation`` mirrors ``flexmarl/orchestrator/pipeline.py`` step for step, with a simulated clock in place of
Dask: the same event loop (admit steps, dispatch generation, dispatch training, handle the next finished
task), the same replica slots and inter-agent balancer, the same micro-batch partition, agent clocks,
training-slot binding, state moves and weight syncs. Every decision is asked of the same objects the runtime
asks: ``SchedulePolicy`` (``admits_step``, ``may_generate``, ``layer_open``, ``pick_requests``,
``pick_replica``, ``training_due``, ``pick_agent``, ``pick_slot``), ``micro_batch_of`` and
``InterAgentBalancer``. Change the policy and the simulation changes with it.

What is simulated instead of run: a worker (a device group) runs one task at a time, highest priority first,
as a Dask worker does; each task's duration comes from the cost model (``costmodel.py``): a generation batch
from the decode curve and the sampled response lengths, a micro-batch from its tokens, a swap or move from the
state size, a sync from the model's sync time. Nothing is tokenised, generated or trained.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from flexmarl.orchestrator.policy import TASK_PRIORITY, SchedulePolicy, deal_slots, micro_batch_of
from flexmarl.rollout.balancer import InterAgentBalancer, Move, Replica, move_slot
from flexmarl.sim.costmodel import Layout, SimPreset


@dataclass(frozen=True)
class SimMode:
    """A schedule to simulate: the same settings ``flexmarl bench pipeline`` overrides for its modes."""

    mode: str  # train.mode: "sync" or "flexmarl"
    pipeline: bool = True  # train.pipeline
    max_staleness: int = 0  # train.max_staleness
    load_balance: bool = True  # rollout.load_balance
    baseline_layout: bool = False  # run on the preset's sync_layout (the MARTI-like colocated cluster)


# The first five are flexmarl/bench/pipeline_bench.py's MODES (a test checks they agree).
MODES: dict[str, SimMode] = {
    "sync": SimMode("sync", load_balance=False, baseline_layout=True),
    "flexmarl": SimMode("flexmarl"),
    "no-lb": SimMode("flexmarl", load_balance=False),
    "no-pipeline": SimMode("flexmarl", pipeline=False),
    "stale1": SimMode("flexmarl", max_staleness=1),
    # Beyond the benchmark's modes: the sync schedule (layered rollout, barrier, train all) on the flexmarl
    # layout, the nearest to the paper's "without the pipeline" ablation, whose training waits for the step.
    "sync-disagg": SimMode("sync"),
}

SPAN_KINDS = ("rollout", "train", "swap", "sync")


@dataclass
class Task:
    kind: str  # generate, sync, train, finish, park, move
    agent: str
    data: tuple
    duration: float = 0.0  # known at submission for generate, sync and finish; at start for the others
    start: float = 0.0
    swap_s: float = 0.0  # the part of a train task spent bringing the agent's state onto the devices


@dataclass
class Worker:
    """A device group that runs its tasks highest priority first, ``lanes`` at a time (a Dask worker: one).

    A rollout worker of a continuous-batching engine has one lane per replica slot: the engine decodes the
    slots' batches together, so a slot's next batch does not wait for another slot's long tail.
    """

    name: str
    devices: int
    role: str  # "rollout", "train" or "both" (colocated)
    lanes: int = 1
    queue: list = field(default_factory=list)  # heap of (-priority, seq, Task)
    running: list[Task] = field(default_factory=list)
    resident: str | None = None  # the agent whose training state is on the devices


@dataclass
class MicroBatch:
    agent: str
    step: int
    index: int
    queries: set[int]
    done_queries: set[int] = field(default_factory=set)
    samples: int = 0
    tokens: int = 0  # prompt + response tokens the trainer processes
    committed: bool = False
    committed_at: float = 0.0
    submitted: bool = False
    trained: bool = False


@dataclass
class StepState:
    step: int
    lengths: dict[str, np.ndarray]  # node -> response length per episode
    prompts: dict[str, np.ndarray]  # node -> prompt length per episode (set when the node is dispatched)
    pending: dict[str, np.ndarray]  # node -> parents not yet done, per episode
    done_nodes: np.ndarray  # per episode
    done_in_group: np.ndarray  # per query: finished episodes
    done_groups: int = 0
    finished_nodes: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # layer -> count


@dataclass(frozen=True)
class UpdateRecord:
    agent: str
    step: int
    finished_at: float
    samples: int
    tokens: int


@dataclass
class SimResult:
    """What a simulated run produced: the clock, every task's span, every update."""

    mode: str
    wall_s: float
    steps: int
    workers: list[Worker]
    span_worker: np.ndarray  # per span: index into workers
    span_kind: np.ndarray  # index into SPAN_KINDS
    span_agent: np.ndarray  # index into agents
    span_start: np.ndarray
    span_end: np.ndarray
    agents: list[str]
    updates: list[UpdateRecord]
    tokens: int  # response tokens generated
    moves: list[Move]
    events: int

    @property
    def devices(self) -> int:
        return sum(w.devices for w in self.workers)

    def busy_s(self) -> np.ndarray:
        """Per worker, the seconds it was busy (the union of its spans: continuous-batching lanes overlap)."""
        busy = np.zeros(len(self.workers))
        order = np.lexsort((self.span_start, self.span_worker))
        worker, start, end = self.span_worker[order], self.span_start[order], self.span_end[order]
        current, lo, hi = -1, 0.0, 0.0
        for w, s, e in zip(worker.tolist(), start.tolist(), end.tolist()):
            if w != current or s > hi:
                if current >= 0:
                    busy[current] += hi - lo
                current, lo, hi = w, s, e
            else:
                hi = max(hi, e)
        if current >= 0:
            busy[current] += hi - lo
        return busy

    def utilization(self) -> float:
        """Busy device-seconds over all device-seconds of the layout."""
        devices = np.array([w.devices for w in self.workers], dtype=float)
        return float(self.busy_s() @ devices) / (self.devices * self.wall_s) if self.wall_s > 0 else 0.0

    def step_ends(self) -> list[float]:
        """When each step's last agent update finished."""
        ends: dict[int, float] = {}
        for u in self.updates:
            ends[u.step] = max(ends.get(u.step, 0.0), u.finished_at)
        return [ends[s] for s in sorted(ends)]

    def step_s(self) -> float:
        """Seconds per step in steady state: between the first step's end and the last's (the first step also
        fills the pipeline); with one step, its time."""
        ends = self.step_ends()
        return ends[0] if len(ends) == 1 else (ends[-1] - ends[0]) / (len(ends) - 1)


class Simulation:
    """One simulated run of ``preset`` under ``mode`` (a key of ``MODES``).

    Args:
        preset: the cluster, cost model, agents, graph and workload.
        mode: the schedule.
        steps: optimizer steps per agent (default: the preset's).
        policy: the schedule policy (default: built from the mode, as ``runtime.schedule_policy`` does).
    """

    def __init__(self, preset: SimPreset, mode: str, *, steps: int | None = None,
                 policy: SchedulePolicy | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.preset, self.mode_name, m = preset, mode, MODES[mode]
        wl = preset.workload
        self.wl = wl
        self.steps_target = steps or wl.steps
        self.agents = list(preset.agents)
        self.agent_index = {a: i for i, a in enumerate(self.agents)}
        self.policy = policy or SchedulePolicy(
            mode=m.mode, steps=self.steps_target, pipeline=m.pipeline,
            max_staleness={a: m.max_staleness for a in self.agents},
        )
        layout: Layout = (preset.cluster.sync_layout if m.baseline_layout and preset.cluster.sync_layout
                          else preset.cluster.layout)
        self.layout = layout

        # ---- workers: rollout workers, and training slots (the same workers when colocated)
        self.workers: list[Worker] = []
        rollout_names = []
        lanes = wl.slots_per_worker if wl.batching == "continuous" else 1
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
        self.slots = sorted(slot_names)

        # ---- the graph, as the runtime's EpisodeGraph sees it
        g = preset.expanded
        self.order = g.order()
        self.turn = {n: i for i, n in enumerate(self.order)}
        self.agent_of = {n.name: n.agent for n in g.nodes}
        self.parents = {n: g.parents(n) for n in self.order}
        self.children = {n: g.children(n) for n in self.order}
        self.layer: dict[str, int] = {}
        for node in self.order:
            self.layer[node] = 1 + max((self.layer[p] for p in self.parents[node]), default=-1)
        self.roots = [n for n in self.order if not self.parents[n]]
        self.nodes_of = {a: [n for n in self.order if self.agent_of[n] == a] for a in self.agents}
        self.episodes = wl.queries_per_step * wl.group_size
        nodes_in_layer: dict[int, int] = defaultdict(int)
        for node in self.order:
            nodes_in_layer[self.layer[node]] += 1
        self.needed = {k: self.episodes * c for k, c in nodes_in_layer.items()}

        # ---- rollout: replica slots dealt round-robin; engines of every agent everywhere when balancing
        rollout_slots = deal_slots(self.agents, rollout_names, wl.slots_per_worker)
        self.replicas: dict[str, list[Replica]] = {a: [] for a in self.agents}
        for worker, agent in rollout_slots:
            self.replicas[agent].append(Replica(agent, worker))
        self.idle = {a: len(r) for a, r in self.replicas.items()}  # replica slots not generating, per agent
        self.engines = {
            a: list(rollout_names) if m.load_balance else sorted({w for w, x in rollout_slots if x == a})
            for a in self.agents
        }
        self.engine_version = {(a, w): 0 for a, ws in self.engines.items() for w in ws}
        self.outstanding_tokens: dict[str, int] = defaultdict(int)
        self.balancer = InterAgentBalancer(
            wl.balance_threshold, wl.balance_cooldown_s,
            min_slots=1 if len(rollout_slots) >= len(self.agents) else 0,
        ) if m.load_balance else None
        self.subreplicas = {  # data-parallel replicas of the agent's model on one rollout worker
            a: layout.devices_per_worker // preset.model_of(a).rollout_devices for a in self.agents
        }
        biggest = wl.max_batch_size
        self.step_table = {a: preset.model_of(a).step_seconds(np.arange(1, biggest + 1, dtype=float))
                           for a in self.agents}

        # ---- training: agents start on the slots round-robin (the runtime's ``place``)
        self.location = {a: self.slots[i % len(self.slots)] for i, a in enumerate(self.agents)}
        self.bound: dict[str, str | None] = {}
        self.versions = {a: 0 for a in self.agents}

        # ---- the loop's state, named as in PipelineRunner
        self.now = 0.0
        self.events: list = []  # heap of (time, seq, kind, payload)
        self.seq = 0
        self.steps: dict[int, StepState] = {}
        self.next_step = 0
        self.waiting: dict[str, list[tuple[int, str, int, str]]] = {a: [] for a in self.agents}
        self.micro: dict[tuple[str, int], list[MicroBatch]] = {}
        self.micro_of_query: dict[tuple[str, int], dict[int, MicroBatch]] = {}
        self.complete: dict[str, set[int]] = {a: set() for a in self.agents}
        self.queued = {a: 0 for a in self.agents}
        self.blocked = {a: False for a in self.agents}
        self.pending_syncs = {a: 0 for a in self.agents}
        self.updates: list[UpdateRecord] = []
        self.tokens = 0
        self.n_events = 0
        # What can make an agent's waiting request eligible: a new request, a sync, a freed or moved slot, and
        # in layered mode any finished node. The dispatcher skips an agent when none of these changed since
        # none of its free replicas could take any of its requests.
        self.changed = {a: 0 for a in self.agents}
        self.layer_progress = 0
        self._stuck: dict[str, tuple[int, int]] = {}
        self.training_dirty = True  # something _dispatch_training reads changed
        self._work: dict[str, tuple | None] = {}  # per agent: its last _training_work answer
        self._work_stale: set[str] = set(self.agents)  # agents whose answer may have changed since
        self._refused: tuple | None = None  # (next step, versions) admits_step last said no to
        self._balanced: tuple | None = None  # (queues, slots, idle) the balancer last said no to, and when
        self._balanced_at = 0.0
        self._spans: tuple[list, list, list, list, list] = ([], [], [], [], [])

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        target = self.steps_target
        while True:
            self._admit_steps()
            self._dispatch_generation()
            self._dispatch_training()
            if not self.events:
                if all(v >= target for v in self.versions.values()):
                    break
                raise RuntimeError(f"simulation stalled with nothing in flight (versions {self.versions})")
            self._next_event()
        w, k, a, s, e = self._spans
        return SimResult(
            self.mode_name, self.now, target, self.workers, np.array(w, dtype=np.int32),
            np.array(k, dtype=np.int8), np.array(a, dtype=np.int16), np.array(s), np.array(e), self.agents,
            self.updates, self.tokens, list(self.balancer.moves) if self.balancer else [], self.n_events,
        )

    def _push(self, at: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def _next_event(self) -> None:
        at, _, kind, payload = heapq.heappop(self.events)
        self.now = at
        self.n_events += 1
        if kind == "commit":
            self._committed(payload)
        elif kind == "part":  # streamed results of a continuous batch: its sequences that just ended
            task, items = payload
            self._on_results(items)
        else:
            worker, task = payload
            worker.running.remove(task)
            self._record_span(worker, task)
            self._start_next(worker)  # the worker takes its next task before the driver hears of this one
            self._handle(task, worker)

    def _record_span(self, worker: Worker, task: Task) -> None:
        kind = {"generate": "rollout", "sync": "sync", "park": "swap", "move": "swap"}.get(task.kind, "train")
        w, k, a, s, e = self._spans
        wi, ai = self.worker_index[worker.name], self.agent_index[task.agent]
        start = task.start
        if task.swap_s:
            w.append(wi), k.append(2), a.append(ai), s.append(start), e.append(start + task.swap_s)
            start += task.swap_s
        w.append(wi), k.append(SPAN_KINDS.index(kind)), a.append(ai), s.append(start), e.append(self.now)

    def _submit(self, worker: Worker, task: Task) -> None:
        self.seq += 1
        heapq.heappush(worker.queue, (-TASK_PRIORITY.get(task.kind, 0), self.seq, task))
        self._start_next(worker)

    def _start_next(self, worker: Worker) -> None:
        overhead = self.preset.driver.task_overhead_s
        while worker.queue and len(worker.running) < worker.lanes:
            _, _, task = heapq.heappop(worker.queue)
            worker.running.append(task)
            task.start = self.now
            self._price_at_start(worker, task)
            if task.kind == "generate" and task.data[4] is not None:  # streamed: each result when its sequence ends
                items, ends = task.data[1], task.data[4]
                interval = self.wl.stream_interval_s
                if interval:  # results return in chunks, at most one per interval (and the last with the batch)
                    ends = np.minimum(np.ceil(ends / interval) * interval, task.duration - task.swap_s)
                order = np.argsort(ends, kind="stable")
                cut = np.flatnonzero(np.diff(ends[order])) + 1  # one event per distinct end time
                begin = self.now + task.swap_s + overhead
                for group in np.split(order, cut):
                    self._push(begin + float(ends[group[0]]), "part", (task, [items[i] for i in group]))
            self._push(self.now + task.duration + overhead, "done", (worker, task))

    def _price_at_start(self, worker: Worker, task: Task) -> None:
        """Costs that depend on what the worker holds when the task starts: swaps of training state."""
        cluster = self.preset.cluster
        bw = cluster.swap_gb_per_s
        if task.kind == "generate" and worker.role == "both" and worker.resident is not None:
            # colocated: rollout needs the devices' memory, so the resident training state goes to host first
            task.swap_s = self._swap_s(worker.resident, bw)
            task.duration += task.swap_s
            worker.resident = None
        elif task.kind in ("train", "finish"):
            if worker.resident != task.agent:
                previous = self._swap_s(worker.resident, bw) if worker.resident else 0.0
                task.swap_s = self._swap_s(task.agent, bw) + previous
                task.duration += task.swap_s
                worker.resident = task.agent
        elif task.kind == "park":
            task.duration = self.preset.model_of(task.agent).state_gb / cluster.move_gb_per_s
            if worker.resident == task.agent:
                worker.resident = None
        elif task.kind == "move":
            task.duration = self.preset.model_of(task.agent).state_gb / cluster.move_gb_per_s
            if worker.resident not in (None, task.agent):
                task.duration += self._swap_s(worker.resident, bw)
            worker.resident = task.agent

    def _swap_s(self, agent: str, bw: float | None) -> float:
        return 0.0 if bw is None else self.preset.model_of(agent).state_gb / bw

    def _handle(self, task: Task, worker: Worker) -> None:
        kind = task.kind
        if kind == "generate":
            self._on_generated(*task.data)
        elif kind == "train":
            self._on_trained(task.data[0])
        elif kind == "finish":
            self._on_step_finished(task.agent, task.data[0])
        elif kind == "sync":
            self._on_synced(task.agent, worker.name, task.data[0])
        elif kind == "park":
            self._submit(self.worker[task.data[0]], Task("move", task.agent, (task.data[0],)))
        elif kind == "move":
            self._on_moved(task.agent, task.data[0])

    # ------------------------------------------------------------------ rollout

    def _admit_steps(self) -> None:
        wl = self.wl
        key = (self.next_step, tuple(self.versions.values()))
        if key == self._refused:  # admits_step depends on the step and the versions only
            return
        while self.next_step not in self.steps and self.policy.admits_step(self.next_step, self.versions):
            step = self.next_step
            rng = np.random.default_rng([wl.seed, step])  # the same draws in every mode
            n = self.episodes
            lengths = {node: self.preset.agents[self.agent_of[node]].response.sample(rng, n) for node in self.order}
            state = StepState(
                step, lengths, {node: np.zeros(n, dtype=np.int64) for node in self.order},
                {node: np.full(n, len(self.parents[node]), dtype=np.int32) for node in self.order},
                np.zeros(n, dtype=np.int32), np.zeros(wl.queries_per_step, dtype=np.int32),
            )
            self.steps[step] = state
            for agent in self.agents:
                per_query = wl.group_size * len(self.nodes_of[agent])
                batches: dict[int, MicroBatch] = {}
                for q in range(wl.queries_per_step):
                    i = micro_batch_of(q, per_query, wl.micro_batch_size)
                    batches.setdefault(i, MicroBatch(agent, step, i, set())).queries.add(q)
                self.micro[(agent, step)] = [batches[i] for i in sorted(batches)]
                self.micro_of_query[(agent, step)] = {q: mb for mb in batches.values() for q in mb.queries}
            for ep in range(n):
                for node in self.roots:
                    self._enqueue(step, ep, node)
            self.next_step += 1
        self._refused = (self.next_step, tuple(self.versions.values())) if self.next_step not in self.steps else None

    def _enqueue(self, step: int, ep: int, node: str) -> None:
        q, j = divmod(ep, self.wl.group_size)
        sid = f"s{step}q{q}_{self.turn[node]}_{j}"  # the runtime's sample id: {input_id}_{turn}_{trajectory}
        agent = self.agent_of[node]
        self.waiting[agent].append((step, sid, ep, node))
        self.changed[agent] += 1

    def _layer_open(self, step: int, node: str) -> bool:
        return self.policy.layer_open(self.layer[node], self.steps[step].finished_nodes, self.needed)

    def _dispatch_generation(self) -> None:
        self._balance()
        for agent, waiting in self.waiting.items():
            if not waiting or not self.idle[agent]:
                continue
            if self._stuck.get(agent) == (self.changed[agent], self.layer_progress):
                continue
            free = {f"{i}": r for i, r in enumerate(self.replicas[agent]) if not r.busy}
            # Shortcuts that change no decision: the requests a replica may take depend only on its version
            # (and the layers done), so a version with none stays without any until something changes.
            nothing_for: set[int] = set()
            limit = self.wl.max_batch_size * max(1, self.subreplicas[agent])
            while free and waiting:
                tokens = {k: self.outstanding_tokens[r.worker] for k, r in free.items()}
                rep = free.pop(self.policy.pick_replica(tokens))
                version = self.engine_version[(agent, rep.worker)]
                if version in nothing_for:
                    continue
                eligible = self._eligible(agent, waiting, version)
                chosen = self.policy.pick_requests([waiting[i][:2] for i in eligible], limit)
                if not chosen:
                    nothing_for.add(version)
                    if all(self.engine_version[(agent, r.worker)] in nothing_for for r in free.values()):
                        self._stuck[agent] = (self.changed[agent], self.layer_progress)
                        break
                    continue
                items = [waiting[eligible[c]] for c in chosen]
                for c in sorted((eligible[c] for c in chosen), reverse=True):
                    del waiting[c]
                estimate = len(items) * self.preset.agents[agent].response.max
                rep.busy = True
                self.idle[agent] -= 1
                self.outstanding_tokens[rep.worker] += estimate
                duration, generated, ends = self._generation_cost(agent, items)
                self._submit(self.worker[rep.worker],
                             Task("generate", agent, (rep, items, estimate, generated, ends), duration))

    def _eligible(self, agent: str, waiting: list[tuple[int, str, int, str]], version: int) -> list[int]:
        """Indices of the waiting requests a replica at ``version`` may take (the runtime's filter); the policy
        is asked once per distinct step and (step, layer), since its answers depend on nothing else."""
        may: dict[int, bool] = {}
        open_: dict[tuple[int, int], bool] = {}
        out = []
        for i, (step, _, _, node) in enumerate(waiting):
            ok = may.get(step)
            if ok is None:
                ok = may[step] = self.policy.may_generate(agent, step, version)
            if not ok:
                continue
            key = (step, self.layer[node])
            layer_ok = open_.get(key)
            if layer_ok is None:
                layer_ok = open_[key] = self._layer_open(step, node)
            if layer_ok:
                out.append(i)
        return out

    def _balance(self) -> None:
        """Inter-agent balancing: move idle replica slots to the longest queues (the runtime's ``_balance``)."""
        if self.balancer is None:
            return
        while True:
            # decide() depends on the queues, slots and idle slots, and on the clock only through the cooldowns
            # of past moves: with the same inputs and no cooldown ended since it last said no, it says no again
            key = (tuple(map(len, self.waiting.values())), tuple(map(len, self.replicas.values())),
                   tuple(self.idle.values()))
            if key == self._balanced and not self._cooldown_ended_since(self._balanced_at):
                return
            queue_depth = {a: len(w) for a, w in self.waiting.items()}
            slots = {a: len(r) for a, r in self.replicas.items()}
            move = self.balancer.decide(self.now, queue_depth, slots, dict(self.idle))
            if move is None:
                self._balanced, self._balanced_at = key, self.now
                return
            move_slot(self.replicas, move, self.outstanding_tokens)
            self.idle[move.source] -= 1
            self.idle[move.target] += 1
            self.changed[move.target] += 1

    def _cooldown_ended_since(self, since: float) -> bool:
        cooldown = self.balancer.cooldown_s
        for move in reversed(self.balancer.moves):  # in time order: stop at the first that ended before
            end = move.at + cooldown
            if end <= since:
                return False
            if end <= self.now:
                return True
        return False

    def _generation_cost(self, agent: str, items: list[tuple[int, str, int, str]]
                         ) -> tuple[float, int, np.ndarray | None]:
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
        for i, (step, _, ep, node) in enumerate(items):
            state = self.steps[step]
            prompt = base + sum(int(state.lengths[p][ep]) for p in self.parents[node])
            state.prompts[node][ep] = prompt
            lengths[i] = state.lengths[node][ep]
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

    def _on_generated(self, rep: Replica, items: list, estimate: int, generated: int, ends) -> None:
        rep.busy = False
        self.idle[rep.agent] += 1
        self.changed[rep.agent] += 1
        self.outstanding_tokens[rep.worker] -= estimate
        self.tokens += generated
        if ends is None:  # static batching: every result returns with the batch
            self._on_results(items)

    def _on_results(self, items: list) -> None:
        if self.policy.layered:
            self.layer_progress += 1
        for step, _, ep, node in items:
            state = self.steps[step]
            state.finished_nodes[self.layer[node]] += 1
            state.done_nodes[ep] += 1
            for child in self.children[node]:
                pending = state.pending[child]
                pending[ep] -= 1
                if pending[ep] == 0:
                    self._enqueue(step, ep, child)
            if state.done_nodes[ep] == len(self.order):
                self._on_episode_done(state, ep)

    def _on_episode_done(self, state: StepState, ep: int) -> None:
        q = ep // self.wl.group_size
        state.done_in_group[q] += 1
        if state.done_in_group[q] < self.wl.group_size:
            return
        state.done_groups += 1
        for agent in self.agents:
            mb = self.micro_of_query[(agent, state.step)][q]
            mb.done_queries.add(q)
            if mb.done_queries == mb.queries:
                self._commit(mb, state)
        if state.done_groups == self.wl.queries_per_step:
            del self.steps[state.step]

    def _commit(self, mb: MicroBatch, state: StepState) -> None:
        g = self.wl.group_size
        episodes = np.concatenate([np.arange(q * g, (q + 1) * g) for q in sorted(mb.queries)])
        nodes = self.nodes_of[mb.agent]
        mb.samples = len(episodes) * len(nodes)
        mb.tokens = int(sum(state.lengths[n][episodes].sum() + state.prompts[n][episodes].sum() for n in nodes))
        if self.preset.driver.commit_s:
            self._push(self.now + self.preset.driver.commit_s, "commit", mb)
        else:
            self._committed(mb)

    def _committed(self, mb: MicroBatch) -> None:
        self._touch(mb.agent)
        mb.committed = True
        mb.committed_at = self.now
        if all(m.committed for m in self.micro[(mb.agent, mb.step)]):
            self.complete[mb.agent].add(mb.step)
            self._touch(*self.agents)  # may_train may read every agent's complete steps (sync mode does)

    # ------------------------------------------------------------------ training

    def _dispatch_training(self) -> None:
        """Agent-centric slots (the runtime's ``_dispatch_training``).

        Skipped when nothing it reads changed since a call that submitted nothing (it would submit nothing again).
        """
        if not self.training_dirty:
            return
        self.training_dirty = False
        for agent in self._work_stale:  # an agent's work changes only with its own state (or any complete step)
            self._work[agent] = self._training_work(agent)
        self._work_stale.clear()
        work = {a: w for a in self.agents if (w := self._work[a])}
        for agent, (_, mb) in sorted(work.items()):
            bound = self.bound.get(agent)
            if bound is not None:
                self._run_training(agent, bound, mb)
        free = [w for w in self.slots if w not in self.bound.values()]
        waiting = {a: w for a, w in work.items() if self.bound.get(a) is None}
        while free and waiting:
            agent = self.policy.pick_agent({a: w[0] for a, w in waiting.items()})
            _, mb = waiting.pop(agent)
            target = self.policy.pick_slot(free, self.location[agent])
            free.remove(target)
            self.bound[agent] = target
            if target == self.location[agent]:
                self._run_training(agent, target, mb)
            else:
                self._move_state(agent, target)

    def _touch(self, *agents: str) -> None:
        self.training_dirty = True
        self._work_stale.update(agents)

    def _training_work(self, agent: str) -> tuple[float, MicroBatch | None] | None:
        step = self.versions[agent]
        if self.blocked[agent] or (agent, step) not in self.micro:
            return None
        return self.policy.training_work(agent, step, self.micro[(agent, step)], self.complete,
                                         queued=self.queued[agent])

    def _run_training(self, agent: str, worker: str, mb: MicroBatch | None) -> None:
        self._touch(agent)
        model = self.preset.model_of(agent)
        devices = self.worker[worker].devices
        if mb is not None:
            mb.submitted = True
            self.queued[agent] += 1
            seconds = mb.tokens / (model.train_tokens_per_s * devices) + model.train_overhead_s
            self._submit(self.worker[worker], Task("train", agent, (mb,), seconds))
        else:
            self.blocked[agent] = True
            self._submit(self.worker[worker], Task("finish", agent, (self.versions[agent],), model.optimizer_step_s))

    def _move_state(self, agent: str, target: str) -> None:
        """Park the agent's state on its old slot, then resume it on ``target`` (two swap spans)."""
        self._touch(agent)
        self.blocked[agent] = True
        self._submit(self.worker[self.location[agent]], Task("park", agent, (target,)))

    def _on_moved(self, agent: str, target: str) -> None:
        self._touch(agent)
        self.location[agent] = target
        self.blocked[agent] = False

    def _on_trained(self, mb: MicroBatch) -> None:
        self._touch(mb.agent)
        mb.trained = True
        self.queued[mb.agent] -= 1

    def _on_step_finished(self, agent: str, step: int) -> None:
        self._touch(agent)
        self.bound[agent] = None
        batches = self.micro.pop((agent, step))
        del self.micro_of_query[(agent, step)]
        self.versions[agent] = step + 1
        self.updates.append(UpdateRecord(agent, step, self.now, sum(m.samples for m in batches),
                                         sum(m.tokens for m in batches)))
        sync_s = self.preset.model_of(agent).weight_sync_s
        for worker in self.engines[agent]:
            self.pending_syncs[agent] += 1
            self._submit(self.worker[worker], Task("sync", agent, (step + 1,), sync_s))

    def _on_synced(self, agent: str, worker: str, version: int) -> None:
        self.changed[agent] += 1
        self.engine_version[(agent, worker)] = version
        self.pending_syncs[agent] -= 1
        if self.pending_syncs[agent] == 0:
            self.blocked[agent] = False
            self._touch(agent)


def simulate(preset: SimPreset, mode: str, *, steps: int | None = None,
             policy: SchedulePolicy | None = None) -> SimResult:
    """Run one mode of ``preset`` and return its result."""
    return Simulation(preset, mode, steps=steps, policy=policy).run()
