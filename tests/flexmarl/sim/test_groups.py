"""Trainer groups on the simulated clock: a rank joins after the park, and the optimizer step is a collective."""

from __future__ import annotations

import pytest

from flexmarl.orchestrator.commands import Finish, Join, Park
from flexmarl.sim.costmodel import SimPreset
from flexmarl.sim.engine import MODES, Running, Simulation
from tests.flexmarl.sim.test_engine import recorded


def finished(sim: Simulation) -> list[tuple[Running, float]]:
    """Every job ``sim`` finishes, with when: filled as it runs."""
    done, finish = [], sim._finished

    def logged(running: Running) -> None:
        done.append((running, sim.now))
        finish(running)

    sim._finished = logged
    return done


def all_reduce_s(preset: SimPreset, ranks: int) -> float:
    """The small preset's one model: a ring all-reduce of its bf16 gradients (its weights' size)."""
    return 2 * (ranks - 1) / ranks * preset.models["m"].weights_gb / preset.cluster.link_gb_per_s


def test_groups_train_every_step_and_their_steps_pay_the_all_reduce(small: SimPreset) -> None:
    sim = Simulation(small, "flexmarl-group")
    done = finished(sim)
    result = sim.run()
    for agent in small.agents:
        assert [u.step for u in result.updates if u.agent == agent] == list(range(small.workload.steps))
    steps = [(r, end) for r, end in done if isinstance(r.job, Finish) and r.job.members]
    assert steps and all(len(r.job.members) == 2 for r, _ in steps)  # two slots: groups of two ranks
    step_s = small.models["m"].optimizer_step_s
    assert all_reduce_s(small, 2) > 0
    for running, end in steps:
        assert end - running.start >= step_s + all_reduce_s(small, 2) - 1e-9  # each rank waits for the all-reduce
    # every rank of one collective ends at once
    ends: dict[tuple[str, int], set[float]] = {}
    for running, end in steps:
        ends.setdefault((running.agent, running.job.step), set()).add(end)
    assert all(len(e) == 1 for e in ends.values())
    # a join runs after its agent's park: it resumes what the park wrote
    parks = [(r.agent, end) for r, end in done if isinstance(r.job, Park)]
    joins = [r for r, _ in done if isinstance(r.job, Join)]
    assert joins and all(any(agent == j.agent and end <= j.start for agent, end in parks) for j in joins)


def test_a_collective_ends_for_every_rank_when_its_last_rank_has_stepped(small: SimPreset) -> None:
    sim = Simulation(small, "flexmarl-group")
    done = finished(sim)
    home, rank = "train-0000", "train-0001"
    for worker in (home, rank):
        sim.worker[worker].resident = "solver"  # both hold the state: no swap in the sums below
    sim._submit(Park("judge", rank))  # the second rank is busy first
    for worker in (home, rank):
        sim._submit(Finish("solver", worker, 0, (home, rank), 1))
    while sim.events:
        sim._next_event()
    park = small.models["m"].state_gb / small.cluster.move_gb_per_s
    end = park + small.models["m"].optimizer_step_s + all_reduce_s(small, 2)
    steps = {r.job.worker: (r.start, at) for r, at in done if isinstance(r.job, Finish)}
    assert steps[home] == (0.0, pytest.approx(end))  # the home holds its slot from its start
    assert steps[rank] == (pytest.approx(park), pytest.approx(end))


def test_a_join_waits_for_the_park_of_the_state_it_resumes(small: SimPreset) -> None:
    sim = Simulation(small, "flexmarl-group")
    done = finished(sim)
    park = sim.sched.inflight.add(Park("solver", "train-0000"))  # under way, as the scheduler tracks it
    sim._submit(park)
    sim._submit(Join("solver", "train-0001", "train-0000"))
    while sim.events:
        sim._next_event()
    move = small.models["m"].state_gb / small.cluster.move_gb_per_s
    join = next(r for r, _ in done if isinstance(r.job, Join))
    assert (join.start, join.start + join.duration) == (pytest.approx(move), pytest.approx(2 * move))
    assert sim.worker["train-0001"].resident == "solver"


@pytest.mark.parametrize("mode", [m for m, spec in MODES.items() if spec.max_slots == 1])
def test_single_slot_modes_form_no_groups(small: SimPreset, mode: str) -> None:
    sim = Simulation(small, mode)
    commands = recorded(sim)
    sim.run()
    assert not any(isinstance(c, Join) or (isinstance(c, Finish) and c.members) for c in commands)
    assert not sim.collectives
