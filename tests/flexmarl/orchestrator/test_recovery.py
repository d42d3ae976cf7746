"""Recovery decisions alone, driven by scripted events: what a lost worker's work becomes."""

from __future__ import annotations

from flexmarl.orchestrator.records import Recovery
from flexmarl.orchestrator.commands import Restore, StartReplica, Sync, JobKind

AGENTS = ("planner", "solver", "judge")


def advance(s, until, limit: int = 10_000) -> None:
    """Finish the oldest task until ``until(s)`` holds."""
    for _ in range(limit):
        s.turn()
        if until(s):
            return
        s.finish(s.running[0])
    raise AssertionError("never reached")


def test_a_lost_rollout_worker_requeues_its_batches_and_gives_its_slots_back(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, rollout=("r0", "r1"), per_worker=2))
    s.turn()
    on_r0 = [t for t in s.jobs(JobKind.GENERATE) if t.worker == "r0"]
    assert on_r0
    lost_ids = {r.sample_id for t in on_r0 for r in t.requests}
    s.s.recovery.lost({"r0"}, Recovery(("r0",), "lost", 0.0))
    s.carry_out()
    assert not [t for t in s.running if t.worker == "r0"]  # given up (Cancel)
    waiting = {r.sample_id for reqs in s.s.rollout.waiting.values() for r in reqs}
    assert lost_ids <= waiting  # back in the queue: per-request seeds make them come out the same elsewhere
    assert all(rep.worker == "r1" for reps in s.s.rollout.replicas.values() for rep in reps)
    assert "r0" not in s.s.rollout.engines["planner"]
    # r0 held a slot of the planner and the judge's only one. r0's nanny started a new worker, r2: the judge
    # gets a slot on the survivor at once, the planner's goes to r2 once its engine runs there
    s.s.recovery.rebuild(["r1", "r2"], ["t0", "t1"], slot_limit=None, replicas_per_worker=2)
    s.carry_out()
    assert [rep.worker for rep in s.s.rollout.replicas["judge"]] == ["r1"]
    starts = [t for t in s.running if isinstance(t, StartReplica)]
    assert [(t.agent, t.worker) for t in starts] == [("planner", "r2")]
    assert s.s.recovery.recoveries[0].recovered_at is None
    s.finish(starts[0])
    assert [rep.worker for rep in s.s.rollout.replicas["planner"]] == ["r1", "r2"]
    s.s.recovery.check_recovered(5.0)
    assert s.s.recovery.recoveries[0].recovered_at == 5.0
    s.run(0)
    assert s.s.versions == {a: 2 for a in AGENTS}


def test_a_lost_trainer_is_restored_and_its_step_trained_again_from_the_start(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, slots=("t0", "t1"), snapshot_every=1,
                         location={"planner": "t0", "solver": "t1", "judge": "t1"}))
    advance(s, lambda s: any(t.worker == "t0" for t in s.jobs(JobKind.TRAIN)))
    agent = next(t.agent for t in s.jobs(JobKind.TRAIN) if t.worker == "t0")
    step = s.s.versions[agent]
    trained_before = [x for x in s.trained if x[0] == agent and x[1] == step]
    s.s.recovery.lost({"t0"}, Recovery(("t0",), "lost", 0.0))
    s.carry_out()
    assert not [t for t in s.running if t.worker == "t0"]
    assert s.s.training.blocked[agent] and s.s.recovery.restores == {agent: step}
    # the partial gradient sum went with the worker: every committed micro-batch of the step trains again
    assert all(not mb.submitted for mb in s.s.training.micro[(agent, step)] if mb.committed)
    s.s.recovery.rebuild(["r0", "r1"], ["t1"], slot_limit=None, replicas_per_worker=2)
    s.carry_out()
    restore = [t for t in s.running if isinstance(t, Restore)]
    assert [(t.agent, t.worker, t.version) for t in restore] == [(agent, "t1", step)]
    s.finish(restore[0])
    assert s.s.training.location[agent] == "t1" and not s.s.training.blocked[agent]  # its engines already hold `step`
    s.run(0)
    assert s.s.versions == {a: 2 for a in AGENTS}
    # each of the step's four micro-batches once more after the rebuild, besides those trained before the loss
    trained = [x for x in s.trained if x[0] == agent and x[1] == step]
    assert len(trained) == len(trained_before) + 4 and {x[2] for x in trained[len(trained_before):]} == set(range(4))


def test_syncs_from_a_lost_trainer_are_redone_from_its_snapshot(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, slots=("t0", "t1"), snapshot_every=1,
                         location={"planner": "t0", "solver": "t1", "judge": "t1"}))
    advance(s, lambda s: any(t.agent == "planner" for t in s.jobs(JobKind.SYNC)))
    s.s.recovery.lost({"t0"}, Recovery(("t0",), "lost", 0.0))
    s.carry_out()
    assert not s.jobs(JobKind.SYNC, "planner")  # they carried weights from the lost trainer's memory
    s.s.recovery.rebuild(["r0", "r1"], ["t1"], slot_limit=None, replicas_per_worker=2)
    s.carry_out()
    s.finish(next(t for t in s.running if isinstance(t, Restore)))
    resync = s.jobs(JobKind.SYNC, "planner")
    assert resync and all(isinstance(t, Sync) and t.source is None and t.version == 1 for t in resync)
    assert s.s.training.blocked["planner"]
    for t in resync:
        s.finish(t, t.version)
    assert not s.s.training.blocked["planner"]
    s.run(0)
    assert s.s.versions == {a: 2 for a in AGENTS}
