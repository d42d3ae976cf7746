"""Trainer groups decided by the scheduler alone (scripted events, no cluster): when an agent's trainer grows into
idle slots, which rank trains what, the collective optimizer step, copies kept and dropped, and a lost rank."""

from __future__ import annotations

import math
import random

import pytest

from flexmarl.orchestrator.commands import (
    CatchUp, Discard, Finish, Join, JobKind, MoveState, Park, Prefetch, Restore, Snapshot, StartReplica, Sync, Train,
)
from flexmarl.orchestrator.records import Recovery

from .test_recovery import advance

AGENTS = ("planner", "solver", "judge")


def finishes(s) -> list[Finish]:
    return [c for c in s.log if isinstance(c, Finish)]


@pytest.mark.parametrize("mode", ["flexmarl", "sync"])
@pytest.mark.parametrize("seed", range(4))
def test_with_groups_every_micro_batch_is_trained_once_and_each_step_is_one_collective(scheduler, script, mode,
                                                                                      seed) -> None:
    s = script(scheduler(mode, steps=3, queries=8, slots=("t0", "t1", "t2", "t3", "t4"), max_slots=3))
    s.run(seed)
    assert s.s.versions == {a: 3 for a in AGENTS}
    assert sorted(s.trained) == sorted((a, step, i) for a in AGENTS for step in range(3) for i in range(8))
    steps: dict[tuple[str, int], list[Finish]] = {}
    for f in finishes(s):
        steps.setdefault((f.agent, f.step), []).append(f)
    assert len(steps) == 9
    for ranks in steps.values():  # one Finish per rank, all of one formation, on the members it names
        assert len(ranks) == max(len(ranks[0].members), 1)
        assert sorted(f.worker for f in ranks) == sorted(ranks[0].members or [ranks[0].worker])
        assert len({f.formation for f in ranks}) == 1
    assert any(len(r[0].members) > 1 for r in steps.values())  # some agent's step did spread
    trains = {(t.agent, t.batch.step): set() for t in s.log if isinstance(t, Train)}
    for t in s.log:
        if isinstance(t, Train):
            trains[(t.agent, t.batch.step)].add(t.worker)
    for key, ranks in steps.items():  # micro-batches went only to the step's ranks
        assert trains[key] <= set(ranks[0].members or [ranks[0].worker])


def test_a_bound_agent_grows_into_an_idle_slot_its_home_parks_for_and_trains_there_once_joined(scheduler,
                                                                                               script) -> None:
    s = script(scheduler("flexmarl", queries=8, group=1, micro=1, slots=("t0", "t1", "t2", "t3", "t4"),
                         max_slots=2, location={"planner": "t0", "solver": "t1", "judge": "t2"}))
    advance(s, lambda s: s.jobs(JobKind.TRAIN, "planner"))
    (join,) = [c for c in s.log if isinstance(c, Join) and c.agent == "planner"]
    assert join.source == "t0" and join.worker in ("t3", "t4")  # an idle slot, not another agent's home
    assert [(p.agent, p.worker) for p in s.log if isinstance(p, Park) and p.agent == "planner"] == [("planner", "t0")]
    assert s.s.training.bound["planner"] == ("t0", join.worker)
    assert {t.worker for t in s.jobs(JobKind.TRAIN, "planner")} == {"t0"}  # not on a rank still joining
    for _ in range(20):
        if not s.s.training.joining["planner"]:
            break
        s.finish(next(j for j in s.running if isinstance(j, (Park, Join)) and j.agent == "planner"))
    advance(s, lambda s: any(t.worker == join.worker for t in s.jobs(JobKind.TRAIN, "planner")))


@pytest.mark.parametrize("seed", [1, 4])  # seeds whose cheap run joins again after the first group
def test_a_join_that_costs_more_than_it_saves_is_not_made_once_its_cost_is_seen(scheduler, script, seed) -> None:
    """Jobs report their seconds: a micro-batch 1 s, a park or a resume 30 s, so a join never pays for itself.
    Until an agent's park and resume were seen, the rule counts micro-batches (so they are seen); after, the
    agent makes no join. At 0.1 s a park or a resume, joins pay, and are made after they were priced too."""
    def run(move_s: float) -> tuple[list[tuple[int, Join]], dict[str, int]]:
        seen: dict[str, set[JobKind]] = {a: set() for a in AGENTS}
        priced_at: dict[str, int] = {}  # agent -> the log's length when both its park and its resume were seen

        def seconds(job) -> float:
            if job.kind in (JobKind.PARK, JobKind.JOIN, JobKind.MOVE_STATE):
                seen[job.agent].add(JobKind.PARK if job.kind is JobKind.PARK else JobKind.JOIN)
                if len(seen[job.agent]) == 2:
                    priced_at.setdefault(job.agent, len(s.log))
                return move_s
            return 1.0

        s = script(scheduler("flexmarl", steps=6, queries=8, group=1, micro=1, slots=("t0", "t1", "t2", "t3"),
                             max_slots=2, location={"planner": "t0", "solver": "t1", "judge": "t2"}),
                   seconds=seconds)
        s.run(seed)
        assert s.s.versions == {a: 6 for a in AGENTS}
        return [(i, c) for i, c in enumerate(s.log) if isinstance(c, Join)], priced_at

    joins, priced_at = run(30.0)
    assert joins and all(i < priced_at.get(j.agent, math.inf) for i, j in joins)  # each made before it was priced
    joins, priced_at = run(0.1)
    assert any(i > priced_at.get(j.agent, math.inf) for i, j in joins)


def test_no_growth_while_an_agent_waits_for_a_slot_nor_past_max_slots(scheduler, script) -> None:
    s = script(scheduler("sync", queries=8, slots=("t0", "t1"), max_slots=2))
    advance(s, lambda s: s.jobs(JobKind.TRAIN))
    # sync: three agents' whole batches at once on two slots: each bound agent keeps one slot, the third waits
    assert not [c for c in s.log if isinstance(c, Join)]
    assert sorted(len(m) for m in s.s.training.bound.values() if m) == [1, 1]
    single = script(scheduler("sync", queries=8, slots=("t0", "t1", "t2"), max_slots=1))
    single.run(0)
    assert not [c for c in single.log if isinstance(c, Join)] and all(not f.members for f in finishes(single))


def test_a_group_s_ranks_keep_fresh_copies_and_copies_left_out_are_dropped(scheduler, script) -> None:
    s = script(scheduler("sync", steps=3, queries=8, slots=("t0", "t1", "t2", "t3", "t4"), max_slots=3))
    s.run(1)
    training = s.s.training
    for agent in AGENTS:  # whatever is left: the home and copies at the agent's final version
        assert all(v == 3 for v in training.copies[agent].values())
    dropped = [c for c in s.log if isinstance(c, Discard) and c.trainer]
    joins = [c for c in s.log if isinstance(c, Join)]
    grouped = [f for f in finishes(s) if f.members]
    # a rank that trained an agent's step before holds its weights: it rejoins without a Join when it can
    assert len(joins) < len({(f.agent, f.step, f.worker) for f in grouped if f.worker != f.members[0]})
    assert all(d.worker != s.s.training.location[d.agent] for d in dropped)


def test_a_lost_rank_gives_up_the_group_s_step_and_the_trainer_is_rebuilt(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, queries=8, group=1, micro=1, slots=("t0", "t1", "t2", "t3", "t4"),
                         max_slots=2, snapshot_every=1, location={"planner": "t0", "solver": "t1", "judge": "t2"}))
    advance(s, lambda s: any(t.worker != "t0" for t in s.jobs(JobKind.TRAIN, "planner")))
    rank = next(t.worker for t in s.jobs(JobKind.TRAIN, "planner") if t.worker != "t0")
    step = s.s.versions["planner"]
    s.s.recovery.lost({rank}, Recovery((rank,), "lost", 0.0))
    s.carry_out()
    assert not [t for t in s.running if t.agent == "planner" and t.kind in (JobKind.TRAIN, JobKind.FINISH)]
    assert s.s.recovery.restores["planner"] == step  # the step's gradient was spread over t0 and the rank: redone
    assert any(isinstance(c, Discard) and c.trainer and c.worker == "t0" for c in s.log)  # the live home's too
    assert not s.s.training.bound.get("planner")
    live = [w for w in ("t0", "t1", "t2", "t3", "t4") if w != rank]
    s.s.recovery.rebuild(["r0", "r1"], live, slot_limit=None, replicas_per_worker=2)
    s.carry_out()
    assert len([t for t in s.running if isinstance(t, Restore) and t.agent == "planner"]) == 1
    s.run(0)
    assert s.s.versions == {a: 2 for a in AGENTS}
    redone = [x for x in s.trained if x[0] == "planner" and x[1] == step]
    assert sorted(set(redone)) == [("planner", step, i) for i in range(8)]


@pytest.mark.parametrize("mode", ["flexmarl", "sync"])
@pytest.mark.parametrize("seed", range(6))
def test_a_formation_used_again_finds_every_rank_still_holding_its_process_group(scheduler, script, mode,
                                                                                 seed) -> None:
    """A rank's process group lives with its trainer copy: a dropped copy (``Discard``) drops it. A formation
    named again must find it on every rank, or its ranks would mix an old group with a new one under one name
    (a fan-out bench failed so: "Connection closed by peer"); a group of the same members formed after a rank
    dropped its copy needs a new formation."""
    s = script(scheduler(mode, steps=6, queries=8, group=1, micro=1, slots=("t0", "t1", "t2", "t3"), max_slots=2))
    s.run(seed)
    held: dict[tuple[str, str], int] = {}  # (agent, worker) -> the formation whose process group it holds
    first: dict[tuple[str, int], int] = {}  # (agent, formation) -> the step it was formed for
    for c in s.log:
        if isinstance(c, Discard) and c.trainer:
            held.pop((c.agent, c.worker), None)
        elif isinstance(c, Finish) and c.members:
            if first.setdefault((c.agent, c.formation), c.step) < c.step:
                assert held.get((c.agent, c.worker)) == c.formation, (c.agent, c.step, c.worker, c.formation)
            held[(c.agent, c.worker)] = c.formation
    assert first


@pytest.mark.parametrize("mode", ["flexmarl", "sync"])
@pytest.mark.parametrize("seed", range(4))
def test_a_sharded_agent_binds_all_its_ranks_and_each_collective_runs_on_every_rank_one_at_a_time(
        scheduler, script, mode, seed) -> None:
    s = script(scheduler(mode, steps=3, queries=8, slots=("t0", "t1", "t2"), max_slots=2, sharded=("solver",),
                         snapshot_every=1, location={"planner": "t1", "solver": "t0", "judge": "t2"}))
    rng = random.Random(seed)
    for _ in range(100_000):
        s.turn()
        solver = [j for j in s.running if j.agent == "solver" and j.kind in (JobKind.TRAIN, JobKind.FINISH,
                                                                            JobKind.SNAPSHOT)]
        # the ranks' collectives in one order: one kind of job, one micro-batch, at a time, on both ranks
        assert len({(j.kind, getattr(j, "batch", None) and j.batch.index) for j in solver}) <= 1
        if any(j.kind is JobKind.TRAIN for j in solver):
            assert set(s.s.training.bound["solver"]) == {"t0", "t1"}
        taken = [w for members in s.s.training.bound.values() for w in members]
        assert len(taken) == len(set(taken))  # no slot bound twice
        if not s.running:
            break
        s.finish(rng.choice(s.running))
    assert s.s.versions == {a: 3 for a in AGENTS}
    assert sorted(s.trained) == sorted([(a, st, i) for a in AGENTS for st in range(3) for i in range(8)]
                                       + [("solver", st, i) for st in range(3) for i in range(8)])  # twice: a rank each
    for kind in (Train, Finish, Snapshot):
        jobs = [c for c in s.log if isinstance(c, kind) and c.agent == "solver"]
        assert jobs and {c.worker for c in jobs} == {"t0", "t1"}
        assert sorted(c.worker for c in jobs).count("t0") == len(jobs) // 2
    assert not [c for c in s.log if isinstance(c, (Park, MoveState, Join, Prefetch)) and c.agent == "solver"]
    assert not [c for c in s.log if isinstance(c, Snapshot) and c.agent == "solver" and c.background]


@pytest.mark.parametrize("mode", ["flexmarl", "sync"])
@pytest.mark.parametrize("seed", range(4))
def test_sharded_agents_share_their_ranks_a_step_each_and_send_every_rank_the_same_collectives_in_order(
        scheduler, script, mode, seed) -> None:
    """Two sharded agents over the same two ranks (one world per worker process): one binds both at a time, for
    a whole step, and each rank is sent the same collective jobs (micro-batch parts, optimizer steps, snapshots)
    in the same order, which a worker runs first in, first out: no rank waits in one agent's collective while
    another waits in the other's."""
    sharded = ("solver", "judge")
    s = script(scheduler(mode, steps=3, queries=8, slots=("t0", "t1", "t2"), max_slots=2, sharded=sharded,
                         snapshot_every=1, location={"planner": "t2", "solver": "t0", "judge": "t0"}))
    rng = random.Random(seed)
    for _ in range(100_000):
        s.turn()
        bound = {a: set(s.s.training.bound.get(a) or ()) for a in sharded}
        assert not (bound["solver"] and bound["judge"])  # a step each
        taken = [w for members in s.s.training.bound.values() for w in members]
        assert len(taken) == len(set(taken))
        if not s.running:
            break
        s.finish(rng.choice(s.running))
    assert s.s.versions == {a: 3 for a in AGENTS}
    collective = [c for c in s.log if isinstance(c, (Train, Finish, Snapshot)) and c.agent in sharded]
    per_rank = {w: [(c.agent, type(c).__name__, getattr(c, "batch", None) and c.batch.index, getattr(c, "step", None))
                    for c in collective if c.worker == w] for w in ("t0", "t1")}
    assert per_rank["t0"] == per_rank["t1"] and {c.agent for c in collective} == set(sharded)


def test_a_lost_rank_of_the_shared_world_rebuilds_every_sharded_agent_in_one_new_world(scheduler, script) -> None:
    sharded = ("solver", "judge")
    s = script(scheduler("flexmarl", steps=2, queries=8, slots=("t0", "t1", "t2"), max_slots=2, sharded=sharded,
                         snapshot_every=1, location={"planner": "t2", "solver": "t0", "judge": "t0"}))
    advance(s, lambda s: s.jobs(JobKind.TRAIN, "solver"))
    s.s.recovery.lost({"t1"}, Recovery(("t1",), "lost", 0.0))  # the judge trains nothing now: hit all the same
    s.carry_out()
    assert set(s.s.recovery.restores) == set(sharded)
    s.s.recovery.rebuild(["r0", "r1"], ["t0", "t2"], slot_limit=None, replicas_per_worker=2)
    s.carry_out()
    restores = [c for c in s.running if isinstance(c, Restore)]
    assert sorted((r.agent, r.worker) for r in restores) == [(a, w) for a in sorted(sharded) for w in ("t0", "t2")]
    assert len({r.formation for r in restores}) == 1 and all(r.members == ("t0", "t2") for r in restores)
    s.run(0)
    assert s.s.versions == {a: 2 for a in AGENTS}


@pytest.mark.parametrize("idle", [True, False])
def test_a_sharded_agent_s_new_engine_starts_at_a_version_its_run_wrote_and_catches_up_from_its_trainer(
        scheduler, script, idle: bool) -> None:
    """Only a sharded agent's ranks together can rebuild a state its run did not write (``run.snapshot_every``):
    a lost rollout worker's replacement engine of the solver starts at the newest version written on schedule
    (v2 of v3), then loads v3 from the trainer's home while the solver is held still; never a ``CatchUp`` from a
    snapshot. Where the solver is mid-step, its update's sync brings the engine up instead."""
    s = script(scheduler("flexmarl", steps=5, queries=8, slots=("t0", "t1", "t2"), max_slots=2, sharded=("solver",),
                         snapshot_every=2, rollout=("r0", "r1", "r3"), per_worker=1,
                         location={"planner": "t1", "solver": "t0", "judge": "t2"}))
    assert [rep.worker for rep in s.s.rollout.replicas["solver"]] == ["r1"]
    if idle:
        advance(s, lambda s: s.s.versions["solver"] == 3 and not s.s.training.blocked["solver"])
    else:
        advance(s, lambda s: s.s.versions["solver"] == 3 and s.jobs(JobKind.FINISH, "solver"))
    s.s.recovery.lost({"r1"}, Recovery(("r1",), "lost", 0.0))
    s.carry_out()
    s.s.recovery.rebuild(["r2"], ["t0", "t1", "t2"], slot_limit=None, replicas_per_worker=1)
    s.carry_out()
    start = next(j for j in s.running if isinstance(j, StartReplica) and j.agent == "solver")
    assert (start.worker, start.version) == ("r2", 2)
    s.finish(start)
    syncs = [j for j in s.running if isinstance(j, Sync) and j.worker == "r2"]
    if idle:
        assert [(j.version, j.source) for j in syncs] == [(3, "t0")] and s.s.training.blocked["solver"]
        s.finish(syncs[0])
        assert s.s.rollout.engine_version[("solver", "r2")] == 3 and not s.s.training.blocked["solver"]
    else:
        assert not syncs and s.s.rollout.engine_version[("solver", "r2")] == 2
    s.run(0)
    assert s.s.versions == {a: 5 for a in AGENTS} and s.s.rollout.engine_version[("solver", "r2")] == 5
    assert not [c for c in s.log if isinstance(c, CatchUp) and c.agent == "solver"]


def test_a_resumed_sharded_agent_s_new_engine_starts_at_the_version_its_attempt_started_from(scheduler,
                                                                                              script) -> None:
    """A run resumed at v4 with ``snapshot_every=3`` (its earlier attempt wrote every second version) wrote v4 at
    its start, never v3: a lost rollout worker's replacement engine of the solver, idle at v5, starts at v4 and
    loads v5 from the trainer's home; once v6 is written on this attempt's schedule, a new engine starts there."""
    s = script(scheduler("flexmarl", steps=8, queries=8, slots=("t0", "t1", "t2"), max_slots=2, sharded=("solver",),
                         snapshot_every=3, rollout=("r0", "r1", "r3"), per_worker=1, versions={a: 4 for a in AGENTS},
                         location={"planner": "t1", "solver": "t0", "judge": "t2"}))
    starts = []
    for lost, new, version in (("r1", "r2", 5), ("r2", "r4", 6)):
        advance(s, lambda s: s.s.versions["solver"] == version and not s.s.training.blocked["solver"])
        s.s.recovery.lost({lost}, Recovery((lost,), "lost", 0.0))
        s.carry_out()
        s.s.recovery.rebuild([new], ["t0", "t1", "t2"], slot_limit=None, replicas_per_worker=1)
        s.carry_out()
        start = next(j for j in s.running if isinstance(j, StartReplica) and j.agent == "solver")
        starts.append((start.worker, start.version))
        s.finish(start)
        syncs = [j for j in s.running if isinstance(j, Sync) and j.worker == new]
        if start.version < version:
            assert [(j.version, j.source) for j in syncs] == [(version, "t0")]
            s.finish(syncs[0])
        assert s.s.rollout.engine_version[("solver", new)] == version
    assert starts == [("r2", 4), ("r4", 6)]
    s.run(0)
    assert s.s.versions == {a: 8 for a in AGENTS}
