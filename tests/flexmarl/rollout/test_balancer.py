"""The inter-agent balancer: moves on disparity past the threshold, never flaps."""

from __future__ import annotations

import math

from flexmarl.rollout.balancer import InterAgentBalancer


def test_moves_an_idle_slot_to_the_longest_queue_past_the_threshold():
    b = InterAgentBalancer(threshold=5, cooldown_s=1.0)
    move = b.decide(0.0, {"a": 0, "b": 24}, {"a": 2, "b": 2}, {"a": 2, "b": 0})
    assert (move.source, move.target) == ("a", "b")
    assert move.target_load == 12.0 and b.moves == [move]


def test_no_move_at_or_below_the_threshold():
    b = InterAgentBalancer(threshold=5, cooldown_s=0.0)
    assert b.decide(0.0, {"a": 0, "b": 10}, {"a": 2, "b": 2}, {"a": 2, "b": 2}) is None  # disparity 5
    assert b.decide(0.0, {"a": 0, "b": 11}, {"a": 2, "b": 2}, {"a": 2, "b": 2}) is not None


def test_only_idle_slots_move_and_min_replicas_is_kept():
    b = InterAgentBalancer(threshold=1, cooldown_s=0.0, min_replicas=1)
    assert b.decide(0.0, {"a": 0, "b": 50}, {"a": 2, "b": 1}, {"a": 0, "b": 0}) is None  # a's slots are busy
    assert b.decide(0.0, {"a": 0, "b": 50}, {"a": 1, "b": 1}, {"a": 1, "b": 0}) is None  # a keeps its last slot
    b0 = InterAgentBalancer(threshold=1, cooldown_s=0.0, min_replicas=0)
    assert b0.decide(0.0, {"a": 0, "b": 50}, {"a": 1, "b": 1}, {"a": 1, "b": 0}).target == "b"


def test_an_agent_with_work_and_no_slot_gets_one():
    assert InterAgentBalancer.load(3, 0) == math.inf
    b = InterAgentBalancer(threshold=5, cooldown_s=0.0, min_replicas=0)
    move = b.decide(0.0, {"a": 1, "b": 3}, {"a": 2, "b": 0}, {"a": 2, "b": 0})
    assert (move.source, move.target) == ("a", "b")


def test_hysteresis_no_move_that_inverts_the_order():
    # a: 6 waiting on 2 slots (3/slot), b: 20 on 1 slot; moving one of a's slots gives a 6/1=6 > b 20/2=10? no:
    # 10 >= 6 is fine. But with a: 12 on 2 and b: 20 on 1, after the move a 12/1=12 > b 10: it would flap back.
    b = InterAgentBalancer(threshold=5, cooldown_s=0.0)
    assert b.decide(0.0, {"a": 6, "b": 20}, {"a": 2, "b": 1}, {"a": 1, "b": 0}) is not None
    b = InterAgentBalancer(threshold=5, cooldown_s=0.0)
    assert b.decide(0.0, {"a": 12, "b": 20}, {"a": 2, "b": 1}, {"a": 1, "b": 0}) is None


def test_cooldown_stops_a_slot_from_moving_straight_back():
    b = InterAgentBalancer(threshold=5, cooldown_s=1.0)
    assert b.decide(0.0, {"a": 0, "b": 30}, {"a": 2, "b": 2}, {"a": 2, "b": 2}).target == "b"
    # the queues flip at once: b just gained, so it gives nothing back until the cooldown ends
    flipped = ({"a": 30, "b": 0}, {"a": 1, "b": 3}, {"a": 1, "b": 3})
    assert b.decide(0.5, *flipped) is None
    move = b.decide(1.5, *flipped)
    assert (move.source, move.target) == ("b", "a") and len(b.moves) == 2


def test_the_slot_that_moves_is_where_the_target_has_fewest_slots_then_least_outstanding():
    pick = InterAgentBalancer.replica_to_move
    assert pick(["w0", "w1"], held=["w1"], outstanding={}) == 0
    assert pick(["w0", "w1"], held=[], outstanding={"w0": 64, "w1": 0}) == 1
    assert pick(["w0", "w1"], held=["w1", "w1"], outstanding={"w0": 64}) == 0


def test_no_move_that_adds_no_worker_to_the_target():
    b = InterAgentBalancer(threshold=1, cooldown_s=0.0)
    queue, slots, idle = {"a": 0, "b": 50, "c": 0}, {"a": 2, "b": 1, "c": 2}, {"a": 1, "b": 0, "c": 1}
    assert b.decide(0.0, queue, slots, idle, adds_capacity=lambda source, target: False) is None
    move = b.decide(0.0, queue, slots, idle, adds_capacity=lambda source, target: source == "c")
    assert (move.source, move.target) == ("c", "b")  # a's idle slot sits where b already has one
