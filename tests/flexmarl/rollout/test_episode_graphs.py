"""Episodes on expanded graphs (fan-out, fan-in, bounded loops with early stop), without Dask.

A scripted loop stands in for the pipeline: it answers each ready node at once with a response chosen by
the test from the node and the rendered prompt, so what the episode graph asks for is observable.
"""

from __future__ import annotations

from collections import deque

import pytest

from flexmarl.meg.spec import MEGSpec
from flexmarl.models.tiny import build_tokenizer
from flexmarl.rollout.backend import GenerationResult
from flexmarl.rollout.episodes import Episode, EpisodeGraph
from flexmarl.rollout.scoring import episode_rows, sample_rows, score
from flexmarl.training.config import TrainerConfig
from flexmarl.workloads.datasets import Problem

TOK = build_tokenizer()


class ScriptedClient:
    """Answers each request at once; ``respond(node, trajectory_id, prompt_text) -> response text``."""

    def __init__(self, respond) -> None:
        self.respond = respond
        self.generated: list[str] = []  # sample ids, in the order they were requested

    def answer(self, sid: str, node: str, traj: int, prompt_ids: list[int]) -> GenerationResult:
        ids = TOK.encode(self.respond(node, traj, TOK.decode(prompt_ids)), add_special_tokens=False)
        self.generated.append(sid)
        return GenerationResult(sid, ids, [-1.0] * len(ids), "stop", 0)


def make_spec(agents: dict, graph: dict) -> MEGSpec:
    full = {name: {"model": "tiny", **a} for name, a in agents.items()}
    return MEGSpec.model_validate({"agents": full, "graph": graph})


def run(spec: MEGSpec, respond, *, group_size: int, answer: str = "4"):
    graph = EpisodeGraph(spec, {a: TOK for a in spec.agents})
    client = ScriptedClient(respond)
    problem = Problem("q7", {"question": "2+2"}, answer)
    episodes = [Episode(problem, j, 0) for j in range(group_size)]
    ready = deque((ep, node) for ep in episodes for node in graph.roots)
    while ready:
        ep, node = ready.popleft()
        prompt = graph.prompt(ep, node)
        result = client.answer(graph.sample_id(ep, node), node, ep.trajectory_id, prompt)
        ready.extend((ep, child) for child in graph.record(ep, node, prompt, result))
    assert all(graph.is_done(ep) for ep in episodes)
    return episodes, client, graph.order


LOOP_AGENTS = {
    "solver": {"prompt": "Solve {question}. Before: {solver} Feedback: {verifier}", "parser": "last_number",
               "reward": "correct_answer"},
    "verifier": {"prompt": "{question} = {solver}? yes or no", "parser": "verdict", "reward": "verdict_matches"},
}
LOOP_GRAPH = {
    "nodes": [{"name": "solver", "agent": "solver"}, {"name": "verifier", "agent": "verifier"}],
    "edges": [["solver", "verifier"], ["verifier", "solver"], ["solver", "solver"]],
    "loops": [{"nodes": ["solver", "verifier"], "max_turns": 3,
               "stop_when": {"node": "verifier", "parsed": "correct"}}],
}
# trajectory -> the turn at which the verifier first says yes (None: never)
ACCEPT_AT = {0: 0, 1: 1, 2: None}


def loop_respond(node: str, traj: int, prompt: str) -> str:
    if node == "summary":
        return "done"
    turn = int(node.rsplit("_t", 1)[1])
    if node.startswith("solver"):
        return f"answer {turn + 3}"  # 3, 4, 5: right at turn 1
    return "yes" if ACCEPT_AT[traj] is not None and turn >= ACCEPT_AT[traj] else "no"


def test_early_stop_skips_the_remaining_turns_and_generates_nothing_for_them() -> None:
    spec = make_spec(LOOP_AGENTS, LOOP_GRAPH)
    episodes, client, _ = run(spec, loop_respond, group_size=3)
    ran = {ep.trajectory_id: sorted(ep.outputs) for ep in episodes}
    assert ran[0] == ["solver_t0", "verifier_t0"]
    assert ran[1] == ["solver_t0", "solver_t1", "verifier_t0", "verifier_t1"]
    assert len(ran[2]) == 6  # never accepted: all three turns
    by_traj = {ep.trajectory_id: ep for ep in episodes}
    assert by_traj[0].skipped == {"solver_t1", "verifier_t1", "solver_t2", "verifier_t2"}
    assert by_traj[1].skipped == {"solver_t2", "verifier_t2"}
    assert by_traj[2].skipped == set()
    # the skipped nodes were never requested from a replica
    assert len(client.generated) == len(set(client.generated)) == 2 + 4 + 6
    generated = set(client.generated)
    order = spec.graph.expanded.order()
    for ep in episodes:
        for node in ep.skipped:
            assert f"q7_{order.index(node)}_{ep.trajectory_id}" not in generated


def test_a_later_turn_reads_the_previous_turn_and_records_its_parents() -> None:
    spec = make_spec(LOOP_AGENTS, LOOP_GRAPH)
    episodes, _, order = run(spec, loop_respond, group_size=3)
    ep = next(e for e in episodes if e.trajectory_id == 2)
    first = TOK.decode(ep.outputs["solver_t0"].prompt_ids)
    assert "Before:  Feedback: <|im_end|>" in first  # turn 0 has no previous turn: the fields are empty
    second = TOK.decode(ep.outputs["solver_t1"].prompt_ids)
    assert "Before: answer 3 Feedback: no" in second
    verifier = TOK.decode(ep.outputs["verifier_t1"].prompt_ids)
    assert "2+2 = answer 4?" in verifier  # the same turn's solver
    turn = {n: i for i, n in enumerate(order)}
    assert ep.outputs["solver_t1"].parent_ids == [f"q7_{turn['verifier_t0']}_2", f"q7_{turn['solver_t0']}_2"]
    assert ep.outputs["solver_t1"].turn == turn["solver_t1"]


def test_group_advantages_only_group_the_samples_that_exist() -> None:
    spec = make_spec(LOOP_AGENTS, LOOP_GRAPH)
    episodes, _, _ = run(spec, loop_respond, group_size=3)
    score(episodes, spec, {a: TrainerConfig() for a in spec.agents})
    by_traj = {ep.trajectory_id: ep for ep in episodes}
    # solver_t1 ran in trajectories 1 and 2 only, both right (4): a group of two equal rewards
    assert by_traj[1].outputs["solver_t1"].reward == by_traj[2].outputs["solver_t1"].reward == 1.0
    assert by_traj[1].outputs["solver_t1"].advantage == by_traj[2].outputs["solver_t1"].advantage == 0.0
    # solver_t0 ran everywhere, always wrong (3); verifier_t0: right to say no, wrong to say yes
    v0 = [by_traj[t].outputs["verifier_t0"] for t in range(3)]
    assert [o.reward for o in v0] == [0.0, 1.0, 1.0]
    assert v0[0].advantage < 0 < v0[1].advantage == v0[2].advantage
    # solver_t2 ran in one trajectory: a group of one, advantage 0
    assert by_traj[2].outputs["solver_t2"].advantage == 0.0
    rows = sample_rows(episodes, "solver")
    assert rows.num_rows == 1 + 2 + 3
    assert len(set(rows["sample_id"].to_pylist())) == rows.num_rows
    assert None not in rows["advantage"].to_pylist()
    status = dict(episode_rows(episodes).to_pylist()[0]["node_status"])
    assert status["solver_t0"] == "done" and status["verifier_t2"] == "skipped"


def test_a_node_after_a_loop_reads_the_latest_turn_that_ran() -> None:
    agents = dict(LOOP_AGENTS, summary={"prompt": "Final: {solver}", "parser": "last_number",
                                        "reward": "correct_answer"})
    graph = dict(LOOP_GRAPH, nodes=[*LOOP_GRAPH["nodes"], {"name": "summary", "agent": "summary"}],
                 edges=[*LOOP_GRAPH["edges"], ["solver", "summary"]])
    spec = make_spec(agents, graph)
    episodes, _, _ = run(spec, loop_respond, group_size=3)
    for ep in episodes:
        last = {0: "answer 3", 1: "answer 4", 2: "answer 5"}[ep.trajectory_id]
        assert f"Final: {last}<|im_end|>" in TOK.decode(ep.outputs["summary"].prompt_ids)
        assert len(ep.outputs["summary"].parent_ids) == 3 - len(ep.skipped) // 2


FAN_AGENTS = {
    "planner": {"prompt": "Plan {question}", "parser": "text", "reward": "final_correct"},
    "solver": {"prompt": "{planner} then solve {question}", "parser": "last_number", "reward": "correct_answer"},
    "aggregator": {"prompt": "{solver}\nSecond alone: {solver_1}\nFinal?", "parser": "last_number",
                   "reward": "correct_answer"},
}
FAN_GRAPH = {
    "nodes": [{"name": "planner", "agent": "planner"}, {"name": "solver", "agent": "solver", "copies": 3},
              {"name": "aggregator", "agent": "aggregator"}],
    "edges": [["planner", "solver"], ["solver", "aggregator"]],
}


def fan_respond(node: str, traj: int, prompt: str) -> str:
    if node == "planner":
        return "add them"
    if node.startswith("solver_"):
        return f"got {int(node[-1]) + 3}"  # 3, 4, 5
    return "4" if traj == 0 else "5"


def test_fan_out_and_fan_in_render_every_copy_and_reward_the_planner_for_the_final_answer() -> None:
    spec = make_spec(FAN_AGENTS, FAN_GRAPH)
    episodes, client, order = run(spec, fan_respond, group_size=2)
    assert order == ["planner", "solver_0", "solver_1", "solver_2", "aggregator"]
    ep = episodes[0]
    assert "add them then solve 2+2" in TOK.decode(ep.outputs["solver_2"].prompt_ids)
    agg = TOK.decode(ep.outputs["aggregator"].prompt_ids)
    assert "Answer 1: got 3\n\nAnswer 2: got 4\n\nAnswer 3: got 5\nSecond alone: got 4\nFinal?" in agg
    assert ep.outputs["aggregator"].parent_ids == [f"q7_{i}_0" for i in (1, 2, 3)]
    score(episodes, spec, {a: TrainerConfig() for a in spec.agents})
    assert [e.outputs["planner"].reward for e in episodes] == [1.0, 0.0]  # the aggregator's success
    assert [e.outputs["solver_1"].reward for e in episodes] == [1.0, 1.0]
    # each copy is its own group (same input, same node)
    assert episodes[0].outputs["planner"].advantage == pytest.approx(-episodes[1].outputs["planner"].advantage)
    assert sample_rows(episodes, "solver").num_rows == 2 * 3
