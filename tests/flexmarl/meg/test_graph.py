"""Expansion of copies and bounded loops, the template rules, and the graph errors in the user's names."""

from __future__ import annotations

import pytest
import yaml

from flexmarl.config import ConfigError, load_config
from flexmarl.meg.graph import GraphError
from flexmarl.meg.spec import GraphSpec


def graph(nodes: list, edges: list, loops: list | None = None) -> GraphSpec:
    return GraphSpec.model_validate({
        "nodes": [n if isinstance(n, dict) else {"name": n, "agent": "a"} for n in nodes],
        "edges": edges,
        "loops": loops or [],
    })


FAN = dict(
    nodes=["planner", {"name": "solver", "agent": "a", "copies": 4}, "aggregator"],
    edges=[["planner", "solver"], ["solver", "aggregator"]],
)
LOOP = dict(
    nodes=["solver", "verifier"],
    edges=[["solver", "verifier"], ["verifier", "solver"]],
    loops=[{"nodes": ["solver", "verifier"], "max_turns": 3, "stop_when": {"node": "verifier", "parsed": "correct"}}],
)


def test_copies_expand_to_numbered_nodes_connected_to_every_parent_and_child() -> None:
    g = graph(**FAN).expanded
    assert g.order() == ["planner", "solver_0", "solver_1", "solver_2", "solver_3", "aggregator"]
    assert g.parents("aggregator") == ["solver_0", "solver_1", "solver_2", "solver_3"]
    assert all(g.parents(f"solver_{i}") == ["planner"] for i in range(4))
    assert {n.agent for n in g.nodes} == {"a"} and g.instances("solver") == [f"solver_{i}" for i in range(4)]


def test_copies_to_copies_connect_every_pair() -> None:
    g = graph(nodes=[{"name": "a", "agent": "a", "copies": 2}, {"name": "b", "agent": "a", "copies": 3}],
              edges=[["a", "b"]]).expanded
    assert all(g.parents(f"b_{j}") == ["a_0", "a_1"] for j in range(3))


def test_fan_in_renders_all_copies_numbered_and_one_copy_alone() -> None:
    g = graph(**FAN).expanded
    texts = {"planner": "P", **{f"solver_{i}": f"s{i}" for i in range(4)}}
    values = g.render_fields("aggregator", texts)
    assert values["solver"] == "Answer 1: s0\n\nAnswer 2: s1\n\nAnswer 3: s2\n\nAnswer 4: s3"
    assert values["solver_2"] == "s2"
    assert g.render_fields("solver_1", texts) == {"planner": "P"}


def test_a_loop_unrolls_into_turns_with_edges_within_and_between_turns() -> None:
    g = graph(**LOOP).expanded
    assert g.order() == ["solver_t0", "verifier_t0", "solver_t1", "verifier_t1", "solver_t2", "verifier_t2"]
    assert g.parents("solver_t0") == []
    assert g.parents("verifier_t1") == ["solver_t1"]  # forward in the loop's list: the same turn
    assert g.parents("solver_t2") == ["verifier_t1"]  # backward: from the previous turn
    assert [n.turn for n in g.nodes] == [0, 1, 2, 0, 1, 2]


def test_in_a_loop_a_field_reads_the_previous_turn_and_is_empty_at_turn_zero() -> None:
    g = graph(**LOOP).expanded
    texts = {"solver_t0": "3", "verifier_t0": "no", "solver_t1": "4"}
    assert g.render_fields("solver_t0", texts) == {"verifier": ""}
    assert g.render_fields("solver_t1", texts) == {"verifier": "no"}
    assert g.render_fields("verifier_t1", texts) == {"solver": "4"}


def test_the_order_of_a_loops_nodes_decides_which_edge_crosses_turns() -> None:
    swapped = dict(LOOP, loops=[{"nodes": ["verifier", "solver"], "max_turns": 2}])
    g = graph(**swapped).expanded
    assert g.parents("verifier_t0") == [] and g.parents("solver_t0") == ["verifier_t0"]
    assert g.parents("verifier_t1") == ["solver_t0"]


def test_a_node_after_a_loop_waits_for_every_turn_and_reads_the_latest() -> None:
    g = graph(nodes=["solver", "verifier", "report"], edges=[*LOOP["edges"], ["verifier", "report"]],
              loops=LOOP["loops"]).expanded
    assert g.parents("report") == ["verifier_t0", "verifier_t1", "verifier_t2"]
    assert g.render_fields("report", {"verifier_t0": "no", "verifier_t1": "yes"}) == {"verifier": "yes"}


def test_stop_rules_skip_the_later_turns_only_on_the_stop_value() -> None:
    g = graph(**LOOP).expanded
    assert g.skipped_after("verifier_t0", "correct") == ("solver_t1", "verifier_t1", "solver_t2", "verifier_t2")
    assert g.skipped_after("verifier_t1", "correct") == ("solver_t2", "verifier_t2")
    assert g.skipped_after("verifier_t2", "correct") == ()  # the last turn: nothing left
    assert g.skipped_after("verifier_t0", "incorrect") == ()
    assert g.skipped_after("solver_t0", "correct") == ()


def test_loop_with_copies_names_copy_then_turn() -> None:
    g = graph(nodes=[{"name": "s", "agent": "a", "copies": 2}, "v"], edges=[["s", "v"], ["v", "s"]],
              loops=[{"nodes": ["s", "v"], "max_turns": 2, "stop_when": {"node": "v", "parsed": "ok"}}]).expanded
    assert g.order() == ["s_0_t0", "s_1_t0", "v_t0", "s_0_t1", "s_1_t1", "v_t1"]
    assert g.render_fields("v_t1", {"s_0_t1": "x", "s_1_t1": "y"})["s"] == "Answer 1: x\n\nAnswer 2: y"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(nodes=["a", "b"], edges=[["a", "b"], ["b", "a"]]),
         r"cycle \(a -> b -> a\).*graph.loops like \{nodes: \[a, b\], max_turns: 3\}"),
        (dict(nodes=["a"], edges=[["a", "a"]]), r"cycle \(a -> a\).*max_turns"),
        (dict(nodes=["a", "b", "c"], edges=[["a", "b"], ["b", "a"], ["b", "c"], ["c", "a"]],
              loops=[{"nodes": ["a", "b"], "max_turns": 2}]),
         r"edges between loop node\(s\) \['a', 'b'\] and \['c'\] go both ways; add \['c'\] to that loop's nodes"),
        (dict(nodes=["a", "b"], edges=[["a", "b"]], loops=[{"nodes": ["a", "x"], "max_turns": 2}]),
         r"graph.loops\[0\].nodes: unknown node 'x'"),
        (dict(nodes=["a", "b"], edges=[["a", "b"], ["b", "a"]],
              loops=[{"nodes": ["a", "b"], "max_turns": 2}, {"nodes": ["b"], "max_turns": 2}]),
         r"graph.loops\[1\].nodes: node 'b' is also in graph.loops\[0\]"),
        (dict(nodes=["a", "b"], edges=[["a", "b"], ["b", "a"]],
              loops=[{"nodes": ["a", "b"], "max_turns": 2, "stop_when": {"node": "z", "parsed": "y"}}]),
         r"graph.loops\[0\].stop_when.node: 'z' is not one of the loop's nodes"),
        (dict(nodes=[{"name": "a", "agent": "a", "copies": 2}, "b"], edges=[["a", "b"], ["b", "a"]],
              loops=[{"nodes": ["a", "b"], "max_turns": 2, "stop_when": {"node": "a", "parsed": "y"}}]),
         r"stop_when.node: 'a' has copies: 2, but a stop condition reads one response"),
        (dict(nodes=["a", "b"], edges=[["a", "b"]],
              loops=[{"nodes": ["a", "b"], "max_turns": 2, "stop_when": {"node": "b", "parsed": "y"}}]),
         r"turn 1 of node 'a' does not wait for 'b' of turn 0.*add an edge \[b, a\]"),
        (dict(nodes=[{"name": "s", "agent": "a", "copies": 3}, "s_1"], edges=[]),
         r"node 's_1' has the name of copy 1 of node 's' \(s_1\); rename one of them"),
        (dict(nodes=["a", "b"], edges=[["a", "b"], ["a", "b"]]), r"edge \[a, b\] is declared twice"),
        (dict(nodes=["a", "b"], edges=[["a", "bb"]]), r"unknown node 'bb' \(did you mean 'b'\?\)"),
    ],
)
def test_graph_errors_name_the_declared_nodes_and_the_fix(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        graph(**spec)


def test_expansion_errors_are_value_errors_pydantic_reports() -> None:
    assert issubclass(GraphError, ValueError)


def test_max_turns_is_required_and_bounded() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        graph(nodes=["a"], edges=[["a", "a"]], loops=[{"nodes": ["a"]}])
    with pytest.raises(ValueError, match="max_turns"):
        graph(nodes=["a"], edges=[["a", "a"]], loops=[{"nodes": ["a"], "max_turns": 0}])


# --- through load_config: errors carry the file and the field -------------------------------------------

def loop_config(tmp_path, **agent_changes) -> str:
    raw = {
        "agents": {
            "solver": {"model": "tiny", "prompt": "Solve {question} {verifier}", "parser": "last_number",
                       "reward": "correct_answer"},
            "verifier": {"model": "tiny", "prompt": "{question} {solver}?", "parser": "verdict",
                         "reward": "verdict_matches"},
        },
        "graph": {**{k: v for k, v in LOOP.items() if k != "nodes"},
                  "nodes": [{"name": "solver", "agent": "solver"}, {"name": "verifier", "agent": "verifier"}]},
        "data": {"dataset": "basic_arithmetic", "size": 8},
        "training": {"micro_batch_size": 12},  # whole groups: group_size 4 x 3 turns
    }
    for agent, changes in agent_changes.items():
        raw["agents"][agent].update(changes)
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_loop_config_validates(tmp_path) -> None:
    cfg = load_config(loop_config(tmp_path))
    assert cfg.nodes_of("solver") == ["solver_t0", "solver_t1", "solver_t2"]
    assert cfg.samples_per_step("solver") == cfg.run.queries_per_step * cfg.run.group_size * 3


def test_template_error_in_a_loop_names_the_declared_node_and_the_file(tmp_path) -> None:
    path = loop_config(tmp_path, solver={"prompt": "Solve {question} {verifer}"})
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    text = str(exc.value)
    assert "loop.yaml" in text and "node 'solver' (agent 'solver')" in text and "_t0" not in text
    assert "prompt field(s) ['verifer'] are provided by neither" in text and "did you mean 'verifier'" in text
    assert "agents.solver.prompt" in text


def test_a_copy_field_beyond_the_copies_is_refused(tmp_path) -> None:
    raw = {
        "agents": {
            "solver": {"model": "tiny", "prompt": "{question}", "parser": "last_number", "reward": "correct_answer"},
            "judge": {"model": "tiny", "prompt": "{solver} {solver_1} {solver_4}", "parser": "last_number",
                      "reward": "correct_answer"},
        },
        "graph": {"nodes": [{"name": "solver", "agent": "solver", "copies": 4}, {"name": "judge", "agent": "judge"}],
                  "edges": [["solver", "judge"]]},
        "data": {"dataset": "basic_arithmetic", "size": 8},
    }
    path = tmp_path / "fan.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"prompt field\(s\) \['solver_4'\] are provided by neither"):
        load_config(path)


def test_unknown_agent_and_missing_model_in_an_expanded_graph(tmp_path) -> None:
    raw = yaml.safe_load(loop_config(tmp_path).read_text())
    raw["graph"]["nodes"][1]["agent"] = "critic"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="node 'verifier' uses unknown agent 'critic'"):
        load_config(path)
    with pytest.raises(ConfigError, match="agents.solver.model: model path .* does not exist"):
        load_config(loop_config(tmp_path, solver={"model": str(tmp_path / "nowhere")}))


def test_a_parent_named_like_a_task_field_is_refused(tmp_path) -> None:
    raw = yaml.safe_load(loop_config(tmp_path).read_text())
    raw["graph"] = {"nodes": [{"name": "question", "agent": "solver"}, {"name": "verifier", "agent": "verifier"}],
                    "edges": [["question", "verifier"]]}
    raw["agents"]["solver"]["prompt"] = "hi"
    raw["agents"]["verifier"]["prompt"] = "{question}"
    path = tmp_path / "clash.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"reads parent field\(s\) \['question'\] that are also problem fields"):
        load_config(path)
