"""The scheduler alone, driven by scripted events: no cluster, no clock, milliseconds per test."""

from __future__ import annotations

import pytest

from flexmarl.orchestrator.commands import (
    Commit, Discard, Generate, Prefetch, RecordUpdate, MoveState, Snapshot, Sync, JobKind, Train,
)

G = JobKind.GENERATE


@pytest.mark.parametrize("mode,staleness,pipeline", [("flexmarl", 0, True), ("flexmarl", 1, True),
                                                      ("flexmarl", 0, False), ("sync", 0, True)])
@pytest.mark.parametrize("seed", range(3))
def test_every_micro_batch_is_trained_exactly_once_in_any_completion_order(scheduler, script, mode, staleness,
                                                                           pipeline, seed) -> None:
    s = script(scheduler(mode, steps=3, staleness=staleness, pipeline=pipeline, slots=("t0",), balance=True))
    s.run(seed)
    assert s.s.versions == {"planner": 3, "solver": 3, "judge": 3}
    # micro-batches of 2 samples hold one whole group of 2 (or of 4, the solver's two copies): four per step
    assert sorted(s.trained) == sorted((a, step, i) for a in ("planner", "solver", "judge")
                                       for step in range(3) for i in range(4))
    generated = [r.sample_id for t in s.log if isinstance(t, Generate) for r in t.requests]
    assert len(generated) == len(set(generated)) == 3 * 4 * 2 * 4  # steps x queries x group x nodes
    assert not s.s.inflight and not s.s.training.micro and not any(s.s.rollout.waiting.values())


def test_a_node_waits_for_its_parents_and_sync_mode_for_the_whole_layer(scheduler, script) -> None:
    s = script(scheduler("sync", queries=2, group=1, micro=1))
    s.turn()
    assert {t.agent for t in s.jobs(G)} == {"planner"}
    first = s.jobs(G)[0]
    done = first.requests[0]
    if len(first.requests) > 1 or len(s.jobs(G)) > 1:  # both episodes' plans in flight
        s.s.done(first)
        s.running.remove(first)
        s.s.node_done(done)
        s.carry_out()
        s.turn()
        # layered: the solver waits for every plan of the step, not only for its own episode's
        assert not s.jobs(G, "solver")


def test_a_committed_micro_batch_trains_while_the_batch_is_still_generated(scheduler, script) -> None:
    s = script(scheduler("flexmarl", queries=4, group=1, micro=1, batch_limit=1))
    # run until the first commit of the solver, then check it trains before the rest of the step is rolled out
    for _ in range(200):
        s.turn()
        if s.jobs(JobKind.TRAIN):
            break
        s.finish(s.running[0])
    train = s.jobs(JobKind.TRAIN)[0]
    assert isinstance(train, Train) and train.batch.committed
    assert not all(mb.committed for mb in s.s.training.micro[(train.agent, 0)])  # the batch is still being generated


def test_agent_wise_advantages_commit_the_agents_whole_batch_at_once(scheduler, script) -> None:
    s = script(scheduler("flexmarl", agent_wise={"solver"}))
    s.run(1)
    commits = [c for c in s.log if isinstance(c, Commit)]
    solver = [c for c in commits if c.agent == "solver"]
    assert len(solver) == 2 and all(c.whole_batch and len(c.batches) == 4 for c in solver)  # one per step
    assert all(not c.whole_batch and len(c.batches) == 1 for c in commits if c.agent != "solver")


def test_staleness_zero_generates_a_step_only_with_that_steps_weights(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, staleness=0))
    seen = []
    for _ in range(10_000):
        s.turn()
        if not s.running:
            break
        task = s.running[0]
        if isinstance(task, Generate):
            version = s.s.rollout.engine_version[(task.agent, task.worker)]
            seen += [(r.step, version) for r in task.requests]
        s.finish(task)
    assert seen and all(step == version for step, version in seen)


def test_an_agent_waiting_for_a_slot_has_its_state_prefetched_to_the_slot_that_frees_first(scheduler,
                                                                                           script) -> None:
    s = script(scheduler("flexmarl", slots=("t0", "t1"), steps=2,
                         location={"planner": "t0", "solver": "t1", "judge": "t1"}))
    resumes = []
    for _ in range(10_000):
        s.turn()
        if not s.running:
            break
        task = s.running[0]
        if isinstance(task, MoveState):
            resumes.append(task)
        s.finish(task)
    prefetches = [c for c in s.log if isinstance(c, Prefetch)]
    # two slots, three agents: the one left waiting has its state read ahead to the slot likely to free first;
    # it resumes there from host memory, or, binding its own slot after all, frees the copy read ahead
    assert prefetches
    ahead = {(p.agent, p.worker) for p in prefetches}
    assert all(r.prefetched == ((r.agent, r.worker) in ahead) for r in resumes)
    discarded = {(d.agent, d.worker) for d in s.log if isinstance(d, Discard) and not d.trainer}
    assert ahead <= discarded | {(r.agent, r.worker) for r in resumes if r.prefetched}
    assert not s.s.training.prefetched


def test_weights_reach_every_engine_of_the_agent_before_it_trains_again(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2))
    for _ in range(10_000):
        s.turn()
        syncs = s.jobs(JobKind.SYNC)
        if syncs:
            break
        s.finish(s.running[0])
    agent = syncs[0].agent
    assert {t.worker for t in syncs if t.agent == agent} == {"r0", "r1"}
    assert all(isinstance(t, Sync) and t.source == s.s.training.location[agent] for t in syncs)
    assert s.s.training.blocked[agent]  # no micro-batch of its next step trains on the old weights' engines' schedule
    for t in [t for t in syncs if t.agent == agent]:
        s.finish(t, t.version)
    assert not s.s.training.blocked[agent]


def test_the_balancer_counts_only_requests_that_could_run_now(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, staleness=0))
    s.turn()
    # the planner's replicas are at v0 and its step-1 requests need v1: they wait for its own weight sync
    s.s.open_step(1, ["s1q0", "s1q1", "s1q2", "s1q3"])
    s.s.start_step(1)
    s.carry_out()
    waiting = len(s.s.rollout.waiting["planner"])
    assert waiting >= 8 and s.s.rollout.runnable("planner") == 0


def test_the_balancers_count_follows_the_queue_as_batches_leave_it(scheduler, script) -> None:
    s = script(scheduler("flexmarl", steps=2, batch_limit=2, per_worker=1, balance=True))
    for _ in range(50):
        s.turn()
        for agent in s.s.agents:
            cached = s.s.rollout.runnable(agent)
            s.s.rollout._runnable.clear()  # what it would count afresh
            assert cached == s.s.rollout.runnable(agent), agent
        if not s.running:
            break
        s.finish(s.running[0])


@pytest.mark.parametrize("every,written", [(0, []), (1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (4, [4, 5]), (6, [5])])
def test_states_are_written_every_k_versions_and_each_before_its_update_is_recorded(scheduler, script, every,
                                                                                   written) -> None:
    s = script(scheduler("flexmarl", steps=5, snapshot_every=every))
    s.run(0)
    assert s.s.versions == {"planner": 5, "solver": 5, "judge": 5}
    for agent in ("planner", "solver", "judge"):
        snapshots = [c.step + 1 for c in s.log if isinstance(c, Snapshot) and c.agent == agent]
        assert snapshots == written
        recorded = [c for c in s.log if isinstance(c, (Snapshot, RecordUpdate)) and c.agent == agent]
        for i, cmd in enumerate(recorded):  # a snapshot comes right before the record of its version
            if isinstance(cmd, Snapshot):
                assert isinstance(recorded[i + 1], RecordUpdate) and recorded[i + 1].step == cmd.step
                assert cmd.background == (cmd.step + 1 < 5)  # the run's last state is whole when the run ends


@pytest.mark.parametrize("mode,pipeline,cut,largest", [("flexmarl", True, True, 4), ("flexmarl", True, False, 16),
                                                       ("flexmarl", False, True, 16), ("sync", True, True, 16)])
def test_pipelined_training_cuts_generation_into_micro_batch_sized_batches(scheduler, script, mode, pipeline, cut,
                                                                          largest) -> None:
    # 8 queries x group 2: 16 requests of the planner per step; micro-batches of 4 samples
    s = script(scheduler(mode, steps=1, queries=8, micro=4, pipeline=pipeline, batch_limit=16,
                         micro_batch_generation=cut))
    s.run(0)
    sizes = [len(t.requests) for t in s.log if isinstance(t, Generate) and t.agent == "planner"]
    assert max(sizes) == largest and sum(sizes) == 16
    if largest == 4:  # both of the planner's replicas sampled
        assert len({t.worker for t in s.log if isinstance(t, Generate) and t.agent == "planner"}) == 2


def test_a_moved_slot_adds_a_worker_never_a_second_slot_on_one_the_agent_already_holds(scheduler, script) -> None:
    # The runtime's deal on 2 workers: planner on r0 and r1, solver on r1, judge on r0. The planner's two batches
    # finish one after the other; its slot on r1 frees first, beside the solver's own. Moving that one would stack
    # the solver twice on r1 (a worker runs one batch at a time), and leave r0 idle once its planner batch ends.
    s = script(scheduler("flexmarl", steps=1, queries=4, group=2, batch_limit=4, balance=True))
    s.turn()
    planner = s.jobs(JobKind.GENERATE, "planner")
    assert sorted(t.worker for t in planner) == ["r0", "r1"]
    s.finish(next(t for t in planner if t.worker == "r1"))
    s.turn()
    assert sorted(r.worker for r in s.s.rollout.replicas["solver"]) == ["r1"]  # r1's free planner slot adds nothing
    s.finish(next(t for t in planner if t.worker == "r0"))
    s.turn()
    assert sorted(r.worker for r in s.s.rollout.replicas["solver"]) == ["r0", "r1"]
    assert {t.worker for t in s.jobs(JobKind.GENERATE, "solver")} == {"r0", "r1"}


@pytest.mark.parametrize("seed", range(4))
def test_no_batch_queues_behind_training_while_a_replica_of_its_agent_only_generates(scheduler, script, seed) -> None:
    # Colocated workers r0 and r1 (each rolls out and trains, one task at a time); every agent has a replica on
    # each. A batch sent to a worker with training queued waits for it; the agent's replica that is generating on
    # the other worker frees sooner, so the batch must wait for that one instead.
    s = script(scheduler("flexmarl", steps=2, queries=6, group=2, micro=2, batch_limit=2, per_worker=3,
                         micro_batch_generation=True, slots=("r0", "r1"), rollout=("r0", "r1")))
    sched, emit, behind = s.s, s.s.rollout.emit, []

    def checked(command: object) -> None:
        if isinstance(command, Generate) and sched.inflight.holding(command.worker):
            behind.append(command)
            assert not any(r.busy and not sched.inflight.holding(r.worker)
                           for r in sched.rollout.replicas[command.agent] if r is not command.replica), command
        emit(command)

    sched.rollout.emit = checked  # the rollout queues emit the generation batches
    s.run(seed)
    assert behind  # batches still go to a training worker when no replica elsewhere would free first
