"""Rollout's half of the scheduler's state: each agent's waiting requests, its replicas and rollout engines, and
the decisions that batch requests onto replicas and move replicas between agents.

``RolloutQueues`` is part of ``Scheduler`` (``scheduler.py``): the scheduler enqueues requests and reports
finished batches and weight syncs; recovery (``recovery.py``) takes lost workers' replicas and engines away and
gives new ones back, through the named operations below. Commands go out through the scheduler's ``emit``.

Memos change no decision, only skip asking again (they make the simulator fast at scale): what can make an
agent's waiting request eligible is a new request, a sync, a freed or moved replica, and in layered (sync) mode
any finished node. ``memo=False`` asks afresh every time; a test runs every simulator mode both ways.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from flexmarl.orchestrator.commands import Generate, InFlight, Request
from flexmarl.orchestrator.policy import AgentShape, SchedulePolicy
from flexmarl.rollout.balancer import InterAgentBalancer, Replica, adds_capacity, move_replica


class RolloutQueues:
    """Requests waiting per agent, the replicas that take them, and the engines behind the replicas.

    Args:
        agents: the agents, in the graph's order.
        shapes: per agent, its batch shape (``scheduler.AgentShape``).
        policy: the schedule's decisions.
        layer: per graph node, its layer (the layered schedule's stage).
        needed: per layer, how many of its nodes a step has.
        finished_nodes: ``finished_nodes(step)``, per layer, the step's nodes finished or skipped so far.
        replicas: the replicas, as (worker, agent it serves first).
        engines: per agent, the workers holding its rollout engine.
        versions: per agent, the version its engines start at.
        balancer: inter-agent balancing, or None.
        inflight: the scheduler's ledger of jobs (read: whether a worker has other work queued).
        emit: the scheduler's way out for commands.
        memo: keep the memos (see the module docstring).
    """

    def __init__(self, *, agents: Sequence[str], shapes: Mapping[str, AgentShape], policy: SchedulePolicy,
                 layer: Mapping[str, int], needed: Mapping[int, int],
                 finished_nodes: Callable[[int], Mapping[int, int]], replicas: Sequence[tuple[str, str]],
                 engines: Mapping[str, Sequence[str]], versions: Mapping[str, int],
                 balancer: InterAgentBalancer | None, inflight: InFlight, emit: Callable[[object], None],
                 memo: bool = True) -> None:
        self.agents, self.shapes, self.policy = list(agents), shapes, policy
        self.layer, self.needed, self.finished_nodes = layer, needed, finished_nodes
        self.balancer, self.inflight, self.emit, self.memo = balancer, inflight, emit, memo
        self.waiting: dict[str, list[Request]] = {a: [] for a in self.agents}
        self.replicas: dict[str, list[Replica]] = {a: [] for a in self.agents}
        for worker, agent in replicas:
            self.replicas[agent].append(Replica(agent, worker))
        self.engines = {a: list(ws) for a, ws in engines.items()}
        self.engine_version = {(a, w): versions[a] for a, ws in engines.items() for w in ws}
        self.outstanding_tokens: dict[str, int] = defaultdict(int)  # per worker: tokens of batches sent to it
        self.queue_trace: list[tuple[float, str, int]] = []
        # memos
        self.changed = {a: 0 for a in self.agents}
        self.layer_progress = 0
        self._stuck: dict[str, tuple[int, int]] = {}
        self._runnable: dict[str, tuple[tuple[int, int], int]] = {}
        self._balanced: tuple | None = None  # the balancer's inputs when it last said no, and when
        self._balanced_at = 0.0

    # ------------------------------------------------------------------ requests in

    def enqueue(self, agent: str, request: Request) -> None:
        self.waiting[agent].append(request)
        self.changed[agent] += 1

    def requeue(self, agent: str, requests: Sequence[Request]) -> None:
        """A lost worker's batch: generated again elsewhere, where per-request seeds give the same samples."""
        for request in requests:
            self.enqueue(agent, request)

    def node_finished(self) -> None:
        """A node of some episode finished: in layered mode, a later layer may open."""
        if self.policy.layered:
            self.layer_progress += 1

    def touch(self, agents: Sequence[str]) -> None:
        """Something the agents' decisions read changed outside the usual events."""
        for agent in agents:
            self.changed[agent] += 1
        self._stuck.clear()
        self._balanced = None

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, now: float) -> None:
        """Record the queues, balance the replicas, and send the waiting requests to free replicas in batches."""
        self._balance(now)
        for agent, waiting in self.waiting.items():
            if not waiting or (self.memo and self._stuck.get(agent) == (self.changed[agent], self.layer_progress)):
                continue
            free = {f"{i}": r for i, r in enumerate(self.replicas[agent]) if not r.busy}
            # the requests a replica may take depend only on its version (and the layers done), so a version
            # with none stays without any until something changes
            nothing_for: set[int] = set()
            shape = self.shapes[agent]
            while free and waiting:
                # intra-agent balancing: a free replica on a worker with no other work queued, then the one whose
                # worker has the fewest tokens outstanding
                rep = free.pop(self.policy.pick_replica(
                    {k: (self.inflight.holding(r.worker), self.outstanding_tokens[r.worker]) for k, r in free.items()}))
                if self.inflight.holding(rep.worker) and self._generating_on_a_free_worker(agent):
                    break  # the batch would wait for a training job; a replica that only generates frees first
                version = self.engine_version[(agent, rep.worker)]
                if version in nothing_for:
                    continue
                eligible = self._eligible(agent, waiting, version)
                chosen = self.policy.pick_requests([(waiting[i].step, waiting[i].sample_id) for i in eligible],
                                                   self.policy.batch_limit(shape.batch_limit, shape.micro_batch_size))
                if not chosen:
                    nothing_for.add(version)
                    continue
                items = tuple(waiting[eligible[c]] for c in chosen)
                for c in sorted((eligible[c] for c in chosen), reverse=True):
                    del waiting[c]
                self.changed[agent] += 1  # its queue shrank: what ``runnable`` counted is out of date
                rep.busy = True
                tokens = len(items) * shape.max_new_tokens
                self.outstanding_tokens[rep.worker] += tokens
                self.emit(Generate(agent, rep.worker, rep, items, tokens))
            if waiting and not any(not r.busy and self.engine_version[(agent, r.worker)] not in nothing_for
                                   for r in self.replicas[agent]):
                self._stuck[agent] = (self.changed[agent], self.layer_progress)

    def _generating_on_a_free_worker(self, agent: str) -> bool:
        """Does a replica of ``agent`` generate on a worker with nothing else queued? It takes the next batch
        when it is done, which is sooner than a worker busy training would start it."""
        return any(r.busy and not self.inflight.holding(r.worker) for r in self.replicas[agent])

    def _eligible(self, agent: str, waiting: list[Request], version: int) -> list[int]:
        """Indices of the waiting requests a replica at ``version`` may take; the policy is asked once per
        distinct step and (step, layer), since its answers depend on nothing else."""
        may: dict[int, bool] = {}
        open_: dict[tuple[int, int], bool] = {}
        out = []
        for i, r in enumerate(waiting):
            ok = may.get(r.step)
            if ok is None:
                ok = may[r.step] = self.policy.may_generate(agent, r.step, version)
            if not ok:
                continue
            key = (r.step, self.layer[r.node])
            layer_ok = open_.get(key)
            if layer_ok is None:
                layer_ok = open_[key] = self.policy.layer_open(key[1], self.finished_nodes(r.step), self.needed)
            if layer_ok:
                out.append(i)
        return out

    def runnable(self, agent: str) -> int:
        """The agent's waiting requests that some engine of its could take now: not those waiting for its own
        weight sync or an earlier layer. The balancer weighs these, since moving a replica to requests that no
        version on it may generate helps nobody."""
        key = (self.changed[agent], self.layer_progress)
        cached = self._runnable.get(agent)
        if self.memo and cached is not None and cached[0] == key:
            return cached[1]
        versions = {self.engine_version[(agent, w)] for w in self.engines[agent] if (agent, w) in self.engine_version}
        count = len({i for v in versions for i in self._eligible(agent, self.waiting[agent], v)})
        self._runnable[agent] = (key, count)
        return count

    def _balance(self, now: float) -> None:
        """Record each agent's queue; inter-agent balancing moves idle replicas to the longest queues."""
        for agent, waiting in self.waiting.items():
            last = next((d for _, a, d in reversed(self.queue_trace) if a == agent), None)
            if last != len(waiting):
                self.queue_trace.append((now, agent, len(waiting)))
        if self.balancer is None:
            return
        while True:
            queue_depth = {a: self.runnable(a) for a in self.agents}
            replicas = {a: len(r) for a, r in self.replicas.items()}
            idle = {a: sum(not x.busy for x in r) for a, r in self.replicas.items()}
            # decide() reads these, where the idle replicas are, and the clock only through past moves' cooldowns
            placement = tuple((r.agent, r.worker, r.busy) for reps in self.replicas.values() for r in reps)
            key = (tuple(queue_depth.values()), placement)
            if self.memo and key == self._balanced and not self.balancer.cooldown_ended_between(
                    self._balanced_at, now):
                return
            move = self.balancer.decide(now, queue_depth, replicas, idle,
                                        partial(adds_capacity, self.replicas, self.balancer.lanes))
            if move is None:
                self._balanced, self._balanced_at = key, now
                return
            # the target's engine is resident on every rollout worker: the replica switches at once
            move_replica(self.replicas, move, self.outstanding_tokens)
            self.changed[move.target] += 1

    # ------------------------------------------------------------------ what finished

    def generated(self, job: Generate) -> None:
        """A batch is done: its replica is free (its results are reported one by one as nodes finish)."""
        job.replica.busy = False
        self.outstanding_tokens[job.worker] -= job.tokens
        self.changed[job.agent] += 1

    def synced(self, agent: str, worker: str, version: int) -> None:
        self.engine_version[(agent, worker)] = version

    # ------------------------------------------------------------------ workers lost and rebuilt (recovery)

    def workers(self) -> set[str]:
        """Workers holding a replica or an engine."""
        return {r.worker for reps in self.replicas.values() for r in reps} | {
            w for ws in self.engines.values() for w in ws}

    def lose_workers(self, lost: set[str]) -> dict[str, int]:
        """Forget the replicas and engines on ``lost`` workers; returns how many replicas each agent lost."""
        taken = {}
        for agent in self.agents:
            self.engines[agent] = [w for w in self.engines[agent] if w not in lost]
            taken[agent] = sum(rep.worker in lost for rep in self.replicas[agent])
            self.replicas[agent][:] = [rep for rep in self.replicas[agent] if rep.worker not in lost]
        for worker in lost:
            self.outstanding_tokens.pop(worker, None)
        self.engine_version = {k: v for k, v in self.engine_version.items() if k[1] not in lost}
        return taken

    def engine_started(self, agent: str, worker: str, version: int) -> None:
        self.engines[agent].append(worker)
        self.engine_version[(agent, worker)] = version

    def caught_up(self, agent: str, worker: str, version: int) -> None:
        """An engine started behind loaded ``version`` (unless it was lost meanwhile)."""
        if (agent, worker) in self.engine_version:
            self.engine_version[(agent, worker)] = max(self.engine_version[(agent, worker)], version)

    def add_replica(self, agent: str, worker: str) -> None:
        self.replicas[agent].append(Replica(agent, worker))

    def has_engines(self, worker: str, agents: Sequence[str]) -> bool:
        return all(worker in self.engines[a] for a in agents)

    def engines_behind(self, agent: str, version: int) -> list[str]:
        """The agent's engines at a version before ``version``."""
        return [w for w in self.engines[agent] if self.engine_version.get((agent, w), version) < version]
