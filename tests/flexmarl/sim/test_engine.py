"""The simulator drives the runtime's policy objects: deterministic, conserving, ordered like the schedules."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from flexmarl.orchestrator.commands import Finish
from flexmarl.orchestrator.policy import SchedulePolicy
from flexmarl.sim.costmodel import SimPreset, load_preset
from flexmarl.sim.engine import MODES, Simulation, simulate


def test_a_run_is_determined_by_the_seed(small: SimPreset) -> None:
    a, b = simulate(small, "flexmarl"), simulate(small, "flexmarl")
    assert a.step_ends() == b.step_ends() and a.tokens == b.tokens
    assert np.array_equal(a.span_start, b.span_start) and np.array_equal(a.span_worker, b.span_worker)
    reseeded = small.model_copy(update={"workload": small.workload.model_copy(update={"seed": 8})})
    assert simulate(reseeded, "flexmarl").tokens != a.tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_every_planned_sample_is_trained_exactly_once(small: SimPreset, mode: str) -> None:
    sim = Simulation(small, mode)
    finishes = recorded(sim, lambda command: isinstance(command, Finish))
    result = sim.run()
    episodes = small.workload.queries_per_step * small.workload.group_size
    for agent in small.agents:
        updates = [u for u in result.updates if u.agent == agent]
        assert [u.step for u in updates] == list(range(small.workload.steps))  # one update per step, in order
        assert all(u.samples == episodes * len(sim.nodes_of[agent]) for u in updates)
    # every micro-batch was trained once: one train span each (one query per micro-batch), plus one span per
    # rank of each optimizer step (the runtime draws both as training); one rank each without trainer groups
    trains = int((result.span_kind == 1).sum())
    updates = small.workload.steps * len(small.agents)
    assert trains == updates * small.workload.queries_per_step + sum(finishes)
    assert sum(finishes) == updates if MODES[mode].max_slots == 1 else sum(finishes) > updates
    # every response drawn for a step was generated: the tokens equal the draws
    drawn = 0
    for step in range(small.workload.steps):
        rng = np.random.default_rng([small.workload.seed, step])
        drawn += sum(int(small.agents[sim.agent_of[n]].response.sample(rng, episodes).sum()) for n in sim.order)
    assert result.tokens == drawn
    assert not sim.waiting["solver"] and not sim.micro and sim.versions == {a: 4 for a in small.agents}


def test_schedules_order_as_the_paper_says_on_a_skewed_preset(small: SimPreset) -> None:
    step = {m: simulate(small, m).step_s() for m in ("sync", "flexmarl", "no-pipeline", "no-lb", "stale1")}
    assert step["flexmarl"] < step["no-pipeline"] < step["sync"]  # the pipeline overlaps training and rollout
    assert step["flexmarl"] < step["no-lb"]  # two rollout workers for three agents: slots must move
    assert step["stale1"] < step["flexmarl"]  # one version ahead: the next step does not wait for the update


def test_load_balancing_moves_slots_and_keeps_their_number(small: SimPreset) -> None:
    sim = Simulation(small, "flexmarl")
    result = sim.run()
    assert result.moves and all(m.target_load - m.source_load > small.workload.balance_threshold for m in result.moves)
    assert sum(len(r) for r in sim.replicas.values()) == 2 * small.workload.replicas_per_worker
    assert not simulate(small, "no-lb").moves


def test_a_change_of_the_runtime_policy_changes_the_simulation(small: SimPreset, monkeypatch) -> None:
    pipelined = simulate(small, "flexmarl")
    unpipelined = simulate(small, "no-pipeline")
    # the runtime's policy object, patched: a micro-batch waits for its agent's whole batch
    monkeypatch.setattr(SchedulePolicy, "may_train", lambda self, agent, step, complete: step in complete[agent])
    patched = simulate(small, "flexmarl")
    assert patched.step_ends() != pipelined.step_ends()
    assert patched.step_ends() == unpipelined.step_ends()  # exactly the no-pipeline schedule


def test_a_policy_passed_in_is_the_one_asked(small: SimPreset) -> None:
    class Counting(SchedulePolicy):
        calls = 0

        def may_generate(self, agent: str, step: int, version: int) -> bool:
            Counting.calls += 1
            return super().may_generate(agent, step, version)

    policy = Counting(mode="flexmarl", steps=2, pipeline=True, max_staleness={a: 0 for a in small.agents})
    result = simulate(small, "flexmarl", steps=2, policy=policy)
    assert Counting.calls > 0 and max(u.step for u in result.updates) == 1


def test_colocated_layout_swaps_training_state_around_rollout(small: SimPreset) -> None:
    layout = small.cluster.layout.model_copy(update={"colocated": True, "devices_per_worker": 4})
    colocated = small.model_copy(update={"cluster": small.cluster.model_copy(update={"layout": layout})})
    result = simulate(colocated, "sync")
    swaps = result.span_kind == 2
    assert swaps.any()  # a state comes back onto devices that rolled out in between
    assert {w.role for w in result.workers} == {"both"}


def test_a_bounded_loop_runs_every_turn_and_trains_each_turns_samples(small: SimPreset) -> None:
    from flexmarl.meg.spec import GraphSpec

    graph = GraphSpec.model_validate({
        "nodes": [{"name": "plan", "agent": "planner"}, {"name": "solve", "agent": "solver"},
                  {"name": "judge", "agent": "judge"}],
        "edges": [["plan", "solve"], ["solve", "judge"], ["judge", "solve"]],
        "loops": [{"nodes": ["solve", "judge"], "max_turns": 3}],
    })
    looped = small.model_copy(update={"graph": graph})
    sim = Simulation(looped, "flexmarl")
    result = sim.run()
    assert sim.nodes_of["solver"] == ["solve_t0", "solve_t1", "solve_t2"]
    episodes = small.workload.queries_per_step * small.workload.group_size
    for agent, turns in (("planner", 1), ("solver", 3), ("judge", 3)):
        assert [u.samples for u in result.updates if u.agent == agent] == [episodes * turns] * small.workload.steps


def recorded(sim: Simulation, keep: Callable[[object], object] = lambda command: command) -> list:
    """What ``keep`` makes of every command the scheduler decides, when the simulator takes it: filled as
    ``sim`` runs."""
    drain, stream = sim.sched.drain, []

    def logged():
        for command in drain():
            stream.append(keep(command))
            yield command

    sim.sched.drain = logged
    return stream


def command_stream(preset: SimPreset, mode: str, *, memo: bool, steps: int | None = None) -> list[str]:
    """Every command the scheduler decided, as it stood when the simulator took it."""
    sim = Simulation(preset, mode, steps=steps, memo=memo)
    stream = recorded(sim, repr)
    sim.run()
    return stream


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("preset_name", ["small", "paper-ma"])
def test_the_schedulers_memos_change_no_decision(small: SimPreset, mode: str, preset_name: str) -> None:
    """The memos only skip questions whose answers cannot have changed: with them off (every question asked
    afresh) the scheduler decides the same commands in the same order, in every mode."""
    preset = small if preset_name == "small" else load_preset(preset_name)
    steps = None if preset_name == "small" else 3
    with_memos = command_stream(preset, mode, memo=True, steps=steps)
    assert len(with_memos) > 100
    assert command_stream(preset, mode, memo=False, steps=steps) == with_memos
