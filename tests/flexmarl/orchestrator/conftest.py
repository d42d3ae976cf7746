"""A scripted executor for the scheduler: no cluster, no clock, no store; jobs finish in a chosen order."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from flexmarl.meg.graph import DeclaredNode, expand
from flexmarl.orchestrator.policy import AgentShape, SchedulePolicy
from flexmarl.orchestrator.scheduler import Scheduler
from flexmarl.orchestrator.commands import (
    Cancel, Commit, Discard, GroupDone, Prefetch, RecordUpdate, Replay, StepDone, Job, JobKind,
)
from flexmarl.rollout.balancer import InterAgentBalancer

# planner -> solver x2 -> judge: three agents, four nodes per episode
GRAPH = expand([DeclaredNode("plan", "planner"), DeclaredNode("solve", "solver", 2), DeclaredNode("judge", "judge")],
               [("plan", "solve"), ("solve", "judge")])
AGENTS = ["planner", "solver", "judge"]


def make(mode: str = "flexmarl", *, steps: int = 2, staleness: int = 0, pipeline: bool = True, queries: int = 4,
         group: int = 2, micro: int = 2, slots=("t0", "t1"), rollout=("r0", "r1"), per_worker: int = 2,
         balance: bool = False, agent_wise=(), versions=None, snapshot_every: int = 0, batch_limit: int = 16,
         location=None, micro_batch_generation: bool = False, max_slots: int = 1, grow_at: int = 2,
         sharded=()) -> Scheduler:
    policy = SchedulePolicy(mode=mode, steps=steps, pipeline=pipeline, max_staleness={a: staleness for a in AGENTS},
                            micro_batch_generation=micro_batch_generation, grow_at=grow_at)
    shapes = {a: AgentShape(micro, 8, batch_limit, a in agent_wise, max_slots, a in sharded) for a in AGENTS}
    replicas = [(w, AGENTS[i % 3]) for i, w in enumerate([w for _ in range(per_worker) for w in rollout])]
    return Scheduler(
        policy=policy, graph=GRAPH, agents=shapes, queries_per_step=queries, group_size=group,
        replicas=replicas, engines={a: list(rollout) for a in AGENTS}, slots=list(slots),
        location=location or {a: slots[i % len(slots)] for i, a in enumerate(AGENTS)},
        versions=versions or {a: 0 for a in AGENTS},
        balancer=InterAgentBalancer(threshold=1, cooldown_s=0) if balance else None, snapshot_every=snapshot_every)


class Script:
    """Carries out a scheduler's commands at once and finishes its jobs when told (``finish``), or in a
    seeded random order (``run``). Everything it saw is kept for the test to read. ``seconds``: what each job
    is reported to have taken (the growth rule's prices); none by default."""

    def __init__(self, sched: Scheduler, seconds: Callable[[Job], float] | None = None) -> None:
        self.s = sched
        self.seconds = seconds
        self.running: list[Job] = []
        self.log: list[object] = []
        self.trained: list[tuple[str, int, int]] = []  # (agent, step, micro-batch index), each training job done
        self.now = 0.0

    def turn(self) -> None:
        while (step := self.s.admissible()) is not None:
            self.s.open_step(step, [f"s{step}q{q}" for q in range(self.s.queries_per_step)])
            self.s.start_step(step)
            self.carry_out()
        self.s.dispatch(self.now)
        self.carry_out()

    def carry_out(self) -> None:
        for cmd in self.s.drain():
            self.log.append(cmd)
            if isinstance(cmd, Job):
                self.running.append(cmd)
            elif isinstance(cmd, Commit):
                for mb in cmd.batches:
                    self.s.committed(mb, self.now)
            elif isinstance(cmd, RecordUpdate):
                self.s.updated(cmd.agent, cmd.step, cmd.step + 1)
            elif isinstance(cmd, Cancel):
                self.running.remove(cmd.job)
            elif not isinstance(cmd, (GroupDone, StepDone, Prefetch, Discard, Replay)):
                raise TypeError(cmd)

    def finish(self, job: Job, value: object = None) -> None:
        self.running.remove(job)
        self.now += 1.0
        seconds = self.seconds(job) if self.seconds else None
        if self.s.done(job, value, seconds) and job.kind is JobKind.GENERATE:
            for r in job.requests:
                self.s.node_done(r)
        if job.kind is JobKind.TRAIN:
            self.trained.append((job.agent, job.batch.step, job.batch.index))
        self.carry_out()

    def jobs(self, kind: JobKind, agent: str | None = None) -> list[Job]:
        return [t for t in self.running if t.kind is kind and (agent is None or t.agent == agent)]

    def run(self, seed: int = 0, target: int | None = None, limit: int = 100_000) -> None:
        rng = random.Random(seed)
        target = target if target is not None else self.s.policy.steps
        for _ in range(limit):
            self.turn()
            if not self.running:
                assert self.s.is_finished(target), f"stalled at versions {self.s.versions}"
                return
            self.finish(rng.choice(self.running))
        raise AssertionError("did not finish")


@pytest.fixture
def scheduler():
    """A factory of small schedulers (see ``make``)."""
    return make


@pytest.fixture
def script():
    """Wraps a scheduler in a scripted executor (see ``Script``)."""
    return Script
