from __future__ import annotations

import math

from flexmarl.orchestrator.commands import Finish, Join, MicroBatch, MoveState, Park, Train
from flexmarl.orchestrator.policy import (
    GrowthPrice, SchedulePolicy, TrainingDue, deal_replicas, micro_batch_of, training_ends,
)
from flexmarl.orchestrator.prices import WINDOW, JobPrices


def policy(mode: str = "flexmarl", *, pipeline: bool = True, k: int = 0) -> SchedulePolicy:
    return SchedulePolicy(mode=mode, steps=3, pipeline=pipeline, max_staleness={"a": k, "b": k})


def test_sync_admits_a_step_only_when_every_agent_is_at_it() -> None:
    p = policy("sync")
    assert p.admits_step(0, {"a": 0, "b": 0})
    assert not p.admits_step(1, {"a": 1, "b": 0})
    assert p.admits_step(1, {"a": 1, "b": 1})
    assert not p.admits_step(3, {"a": 3, "b": 3})  # past the last step


def test_flexmarl_admits_a_step_as_soon_as_one_agent_may_generate_it() -> None:
    p = policy()
    assert p.admits_step(1, {"a": 1, "b": 0})
    assert not p.admits_step(2, {"a": 1, "b": 0})
    assert policy(k=1).admits_step(2, {"a": 1, "b": 0})


def test_staleness_bound_is_enforced_on_generation() -> None:
    assert policy().may_generate("a", 2, 2)
    assert not policy().may_generate("a", 2, 1)
    assert policy(k=1).may_generate("a", 2, 1)
    assert not policy(k=1).may_generate("a", 3, 1)
    assert not policy(k=5).may_generate("a", 1, 2)  # never ahead of the batch it feeds


def test_when_a_micro_batch_may_train() -> None:
    complete = {"a": {0}, "b": set()}
    assert policy().may_train("b", 0, complete)  # pipelined: at once
    assert not policy(pipeline=False).may_train("b", 0, complete)  # no-pipeline: the agent's whole batch
    assert policy(pipeline=False).may_train("a", 0, complete)
    assert not policy("sync").may_train("a", 0, complete)  # sync: every agent's whole batch
    assert policy("sync").may_train("a", 0, {"a": {0}, "b": {0}})


def test_intra_agent_routing_and_request_order() -> None:
    assert SchedulePolicy.pick_replica({"r1": (0, 40), "r0": (0, 10), "r2": (0, 10)}) == "r0"
    assert SchedulePolicy.pick_replica({"r0": (1, 0), "r1": (0, 40)}) == "r1"  # r0's worker trains
    waiting = [(2, "x"), (1, "b"), (1, "a"), (3, "c")]
    assert SchedulePolicy.pick_requests(waiting, 3) == [2, 1, 0]  # oldest step, then sample id


def test_micro_batches_are_whole_groups_of_consecutive_queries() -> None:
    # 4 samples per query (group 4, one node), micro-batch 8 -> two queries per micro-batch
    assert [micro_batch_of(q, 4, 8) for q in range(5)] == [0, 0, 1, 1, 2]
    # a group larger than the micro-batch still stays whole
    assert [micro_batch_of(q, 12, 8) for q in range(3)] == [0, 1, 2]


def test_layered_rollout_opens_a_layer_once_every_earlier_one_is_done() -> None:
    needed = {0: 8, 1: 24, 2: 8}
    assert policy("sync").layer_open(0, {}, needed)
    assert not policy("sync").layer_open(1, {0: 7}, needed)
    assert policy("sync").layer_open(1, {0: 8}, needed)
    assert not policy("sync").layer_open(2, {0: 8, 1: 23}, needed)
    assert policy().layer_open(2, {}, needed)  # flexmarl: a node starts when its own parents are done


def test_training_due_micro_batches_up_to_the_queue_depth_then_the_optimizer_step() -> None:
    complete = {"a": set(), "b": set()}
    p = policy()
    assert p.training_due("a", 0, complete, ready=True, queued=1, all_trained=False) is TrainingDue.MICRO_BATCH
    assert p.training_due("a", 0, complete, ready=True, queued=2, all_trained=False) is None  # slot queue full
    assert policy(pipeline=False).training_due("a", 0, complete, ready=True, queued=0, all_trained=False) is None
    done = {"a": {0}, "b": set()}
    assert p.training_due("a", 0, done, ready=False, queued=0, all_trained=True) is TrainingDue.OPTIMIZER_STEP
    assert p.training_due("a", 0, done, ready=False, queued=1, all_trained=False) is None


def test_a_training_slot_is_the_first_preferred_one_that_is_free() -> None:
    assert SchedulePolicy.pick_slot(["w1", "w2"], "w2") == "w2"
    assert SchedulePolicy.pick_slot(["w1", "w2"], "w3") == "w1"
    assert SchedulePolicy.pick_slot(["w1", "w2", "w3"], None, "w3") == "w3"  # nothing read ahead: its home
    assert SchedulePolicy.pick_slot(["w1", "w2", "w3"], "w2", "w3") == "w2"  # read ahead beats home


def test_replica_slots_are_dealt_round_robin_and_every_agent_gets_one() -> None:
    assert deal_replicas(["p", "s", "a"], ["w0", "w1"], 2) == [("w0", "p"), ("w1", "s"), ("w0", "a"), ("w1", "p")]
    dealt = deal_replicas([f"a{i}" for i in range(5)], ["w0", "w1"], 1)
    assert sorted(a for _, a in dealt) == sorted([f"a{i}" for i in range(5)] + ["a0"])


def test_unpriced_a_group_grows_with_enough_of_its_step_left_for_the_new_rank_and_never_past_max_slots() -> None:
    p = policy()
    assert p.grows(2, 1, 2) and not p.grows(1, 1, 2)  # a join copies the state: grow_at (2) micro-batches per rank
    assert p.grows(1, 1, 2, copy_held=True)  # a slot holding a copy at the agent's version: one is enough
    assert not p.grows(4, 2, 2) and p.grows(4, 2, 3) and not p.grows(3, 2, 3)
    assert not p.grows(9, 1, 1, copy_held=True)  # max_slots 1: never


def test_priced_a_group_grows_only_where_its_step_ends_sooner_by_more_than_the_rank_costs() -> None:
    p = policy()
    # 10 s a micro-batch; the home parks for 3 s, the new rank trains from 8 s (the park, then a 5 s resume)
    join = GrowthPrice(micro_batch_s=10.0, park_s=3.0, join_s=8.0, reduce_s=2.0, displaced_s=0.0)
    assert not p.grows(2, 1, 2, price=join)  # 20 s on one rank; 13 and 18 s on two: saves 2 s, not more than 2
    assert p.grows(3, 1, 2, price=join)  # 30 s against 13, 18, 23: saves 7 s
    assert not p.grows(3, 1, 2, price=GrowthPrice(10.0, 3.0, 8.0, 9.0, 0.0))  # 7 s saved < 9 s of all-reduce
    displacing = GrowthPrice(10.0, 3.0, 8.0, 2.0, displaced_s=9.0)  # the slot is home to an agent training this step
    assert not p.grows(3, 1, 2, price=displacing) and p.grows(4, 1, 2, price=displacing)  # 7 < 11 < 12 (40 vs 28)
    assert not p.grows(99, 1, 2, price=GrowthPrice(10.0, 0.0, 0.0, 0.0, math.inf))  # a displacement not priced
    held = GrowthPrice(10.0, 0.0, 0.0, 2.0, 0.0)  # the slot holds a copy: nothing to load
    assert not p.grows(1, 1, 2, price=held) and p.grows(2, 1, 2, price=held)  # a micro-batch is not split
    assert p.grows(3, 2, 3, price=held) and not p.grows(4, 2, 3, price=held)  # 20 s vs 10; 20 s vs 20
    assert not p.grows(99, 2, 2, price=held)  # never past max_slots


def test_training_ends_with_the_last_whole_micro_batch_on_the_rank_that_frees_first() -> None:
    assert training_ends(3, 10.0, [3.0, 8.0]) == 23.0
    assert training_ends(1, 10.0, [0.0, 50.0]) == 10.0  # a rank that gets none does not count
    assert training_ends(0, 10.0, [5.0]) == 0.0


def test_a_group_queues_one_micro_batch_per_rank() -> None:
    p, complete = policy(), {"a": {0}}
    assert p.training_due("a", 0, complete, ready=True, queued=1, all_trained=False) is TrainingDue.MICRO_BATCH
    assert p.training_due("a", 0, complete, ready=True, queued=1, all_trained=False, ranks=2) is None
    assert p.training_due("a", 0, complete, ready=True, queued=0, all_trained=False, ranks=2) is TrainingDue.MICRO_BATCH


def test_prices_are_the_medians_of_the_recent_jobs_seen() -> None:
    prices = JobPrices()
    mb = MicroBatch("a", 0, 0, {0})
    assert prices.of("a", "train") is None and prices.move_s("a") is None and prices.reduce_s("a", 1) == 0.0
    for seconds in (50.0, *[4.0] * WINDOW):  # the first, slow one has left the window
        prices.observe(Train("a", "w0", mb), seconds)
    assert prices.of("a", "train") == 4.0 and prices.of("b", "train") is None
    prices.observe(Park("a", "w0"), 3.0)
    assert prices.move_s("a") is None  # a move is a park and a resume
    prices.observe(MoveState("a", "w1", "w0", prefetched=True), 0.5)  # read ahead: not a resume's price
    assert prices.move_s("a") is None
    prices.observe(Join("a", "w1", "w0"), 5.0)
    assert prices.move_s("a") == 8.0
    prices.observe(Finish("a", "w0", 0, ("w0", "w1")), 9.0)  # a group's step before a one-rank one: not priced
    assert prices.reduce_s("a", 1) == 0.0
    prices.observe(Finish("a", "w0", 0), 6.0)
    prices.observe(Finish("a", "w0", 1, ("w0", "w1", "w2", "w3")), 9.0)  # 3 s more at 2 (k - 1) / k = 1.5
    assert prices.reduce_s("a", 1) == 2.0 and abs(prices.reduce_s("a", 3) - 1 / 3) < 1e-12  # 2 x (3/2 - 4/3)
