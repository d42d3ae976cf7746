from __future__ import annotations

import pytest
import yaml

from flexmarl.config import ConfigError, load_config
from flexmarl.meg.spec import GraphSpec


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def tiny_raw() -> dict:
    from importlib import resources

    return yaml.safe_load(resources.files("flexmarl.presets").joinpath("tiny.yaml").read_text())


def config_with(tmp_path, **changes) -> str:
    raw = tiny_raw()
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return write(tmp_path, yaml.safe_dump(raw))


def test_presets_are_valid() -> None:
    assert load_config(preset="tiny").graph.order() == ["solver", "verifier"]
    # the default team: a rejected answer gets a second turn
    assert load_config(preset="default").graph.order() == ["solver_t0", "verifier_t0", "solver_t1", "verifier_t1"]


def test_cycle_is_rejected_with_its_path(tmp_path) -> None:
    path = config_with(tmp_path, graph__edges=[["solver", "verifier"], ["verifier", "solver"]])
    with pytest.raises(ConfigError, match=r"cycle \((solver -> verifier -> solver|verifier -> solver -> verifier)\)"):
        load_config(path)


def test_unknown_agent_in_a_node(tmp_path) -> None:
    path = config_with(tmp_path, graph__nodes=[{"name": "solver", "agent": "solver"},
                                               {"name": "verifier", "agent": "critic"}])
    with pytest.raises(ConfigError, match="node 'verifier' uses unknown agent 'critic'"):
        load_config(path)


def test_edge_to_unknown_node(tmp_path) -> None:
    path = config_with(tmp_path, graph__edges=[["solver", "judge"]])
    with pytest.raises(ConfigError, match="edge \\[solver, judge\\] names unknown node 'judge'"):
        load_config(path)


def test_template_field_no_parent_provides(tmp_path) -> None:
    raw = tiny_raw()
    raw["agents"]["verifier"]["prompt"] = "{question} {planner}"
    with pytest.raises(ConfigError, match=r"prompt field\(s\) \['planner'\] are provided by neither"):
        load_config(write(tmp_path, yaml.safe_dump(raw)))


def test_missing_model_path(tmp_path) -> None:
    raw = tiny_raw()
    raw["agents"]["solver"]["model"] = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="agents.solver.model: model path .* does not exist"):
        load_config(write(tmp_path, yaml.safe_dump(raw)))


def test_unknown_key_suggests_the_nearest(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"run.stepz: unknown key \(did you mean 'steps'\?\)"):
        load_config(preset="tiny", overrides=["run.stepz=3"])


def test_wrong_type_names_the_field() -> None:
    with pytest.raises(ConfigError, match="run.steps: Input should be a valid integer"):
        load_config(preset="tiny", overrides=["run.steps=many"])


def test_malformed_yaml_gives_the_line(tmp_path) -> None:
    path = write(tmp_path, "agents:\n  solver: {model: tiny\n  verifier: x\n")
    with pytest.raises(ConfigError, match="malformed YAML at line 3"):
        load_config(path)


def test_unregistered_reward_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown reward 'verdict_match' \\(did you mean 'verdict_matches'\\?\\)"):
        load_config(preset="tiny", overrides=["agents.verifier.reward=verdict_match"])


def test_overrides_apply_and_parse_types() -> None:
    cfg = load_config(preset="tiny", overrides=["run.steps=5", "training.lr=1e-4"])
    assert cfg.run.steps == 5 and cfg.training.lr == pytest.approx(1e-4)


def test_topological_order_is_deterministic_for_fan_out_and_fan_in() -> None:
    graph = GraphSpec.model_validate({
        "nodes": [{"name": n, "agent": "a"} for n in ("plan", "s2", "s1", "agg")],
        "edges": [["plan", "s1"], ["plan", "s2"], ["s1", "agg"], ["s2", "agg"]],
    })
    assert graph.order() == ["plan", "s2", "s1", "agg"]
    assert graph.parents("agg") == ["s1", "s2"]


def test_per_agent_trainer_overrides() -> None:
    cfg = load_config(preset="tiny", overrides=["agents.verifier.training={lr: 1.0e-5, kl_coef: 0.01}"])
    assert cfg.trainer_config("verifier").lr == pytest.approx(1e-5)
    assert cfg.trainer_config("verifier").kl_coef == pytest.approx(0.01)
    assert cfg.trainer_config("solver") == cfg.training
    with pytest.raises(ConfigError, match="agents.verifier.training: lrr: unknown key"):
        load_config(preset="tiny", overrides=["agents.verifier.training={lrr: 1.0e-5}"])


def test_the_answer_node_must_be_a_node_and_defaults_to_the_last() -> None:
    assert load_config(preset="default").graph.answer_node() == "solver"
    assert load_config(preset="fan_out").graph.answer_node() == load_config(preset="fan_out").graph.nodes[-1].name
    with pytest.raises(ConfigError, match="graph.answer names unknown node 'solvr'.*did you mean 'solver'"):
        load_config(preset="default", overrides=["graph.answer=solvr"])


CHECK = ["graph.nodes=[{name: solver, agent: solver}, {name: verifier, agent: verifier}, "
         "{name: check, agent: verifier, prompt: 'Compute: {question}', parser: last_number, reward: correct_answer}]",
         "graph.edges=[[solver, verifier], [check, verifier]]", "agents.verifier.training={micro_batch_size: 16}"]


def test_a_node_plays_its_own_role_where_it_sets_one() -> None:
    cfg = load_config(preset="tiny", overrides=CHECK)
    check, verdict = cfg.role("check"), cfg.role("verifier")
    assert (check.agent, check.prompt, check.parser, check.reward) == (
        "verifier", "Compute: {question}", "last_number", "correct_answer")
    spec = cfg.agents["verifier"]
    assert (verdict.prompt, verdict.parser, verdict.reward) == (spec.prompt, spec.parser, spec.reward)
    with pytest.raises(ConfigError, match="unknown parser 'last_numbr'.*did you mean 'last_number'"):
        load_config(preset="tiny", overrides=[CHECK[0].replace("parser: last_number", "parser: last_numbr"),
                                              *CHECK[1:]])
    # the node's own prompt is checked against its parents, and the error names where to fix it
    with pytest.raises(ConfigError, match=r"node 'check'.*\['solver'\].*fix node check's prompt"):
        load_config(preset="tiny", overrides=[CHECK[0].replace("Compute: {question}", "{solver}"), *CHECK[1:]])


def test_a_comparing_parser_needs_a_parent_to_compare_with() -> None:
    cfg = load_config(preset="tiny", overrides=["agents.verifier.parser=same_result"])
    assert cfg.role("verifier").parser == "same_result"
    with pytest.raises(ConfigError, match="compares the node's result with its first parent's answer.*add an edge"):
        load_config(preset="tiny", overrides=["agents.verifier.parser=same_result", "graph.edges=[]",
                                              "agents.verifier.prompt='{question}'"])


def test_a_reward_scored_on_the_group_needs_a_comparing_parser() -> None:
    cfg = load_config(preset="tiny", overrides=["agents.verifier.parser=same_result",
                                                "agents.verifier.reward=verdict_on_group"])
    assert cfg.role("verifier").reward == "verdict_on_group"
    with pytest.raises(ConfigError, match="'verdict_on_group' scores the node's result.*set its parser to one of"):
        load_config(preset="tiny", overrides=["agents.verifier.reward=verdict_on_group"])
