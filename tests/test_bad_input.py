"""Every kind of bad input FlexMARL refuses or survives: one case each, asserting the message a user sees.

A case triggers the problem with real components (config files, model directories, Delta tables, a Dask
scheduler, an HTTP socket) and returns the message; the test checks that it names the problem and the fix.
The store cases also check that committed data is intact afterwards. ``docs/errors.md`` lists the same kinds:
its ``test`` column holds a case id here (or a deeper test), and its message column must match the message
the case produced. ``see`` names the deeper test of the same behaviour, where there is one.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
ERRORS_DOC = ROOT / "docs" / "errors.md"


@dataclass(frozen=True)
class Case:
    id: str
    trigger: Callable[[Path], str]  # makes the problem happen under tmp_path; returns the message seen
    expect: tuple[str, ...]  # regular expressions the message must match: the problem and the fix
    see: str = ""  # the deeper test of the same behaviour (path::function), if any


def raised(exc_type: type[BaseException], fn: Callable[[], object]) -> str:
    with pytest.raises(exc_type) as info:
        fn()
    return str(info.value)


# ------------------------------------------------------------------ configs


def tiny_raw() -> dict:
    return yaml.safe_load(resources.files("flexmarl.presets").joinpath("tiny.yaml").read_text())


def config_error(tmp_path: Path, raw: dict | None = None, *, text: str | None = None,
                 overrides: tuple[str, ...] = ()) -> str:
    from flexmarl.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(raw if raw is not None else tiny_raw()))
    return raised(ConfigError, lambda: load_config(path, overrides=list(overrides)))


def with_change(change: Callable[[dict], None]) -> dict:
    raw = tiny_raw()
    change(raw)
    return raw


def unknown_preset(tmp_path: Path) -> str:
    from flexmarl.config import ConfigError, load_config

    return raised(ConfigError, lambda: load_config(preset="tinny"))


def missing_config(tmp_path: Path) -> str:
    from flexmarl.config import ConfigError, load_config

    return raised(ConfigError, lambda: load_config(tmp_path / "nope.yaml"))


def bad_override(tmp_path: Path) -> str:
    from flexmarl.config import ConfigError, load_config

    return raised(ConfigError, lambda: load_config(preset="tiny", overrides=["train.steps"]))


# ------------------------------------------------------------------ models and data


def model_copy(tmp_path: Path) -> Path:
    from flexmarl.models.loading import resolve_model

    target = tmp_path / "model"
    shutil.copytree(resolve_model("tiny"), target)
    return target


def pickled_weights(tmp_path: Path) -> str:
    model = model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")  # never loaded: that is the point
    return config_error(tmp_path, with_change(lambda r: r["agents"]["solver"].update(model=str(model))))


def not_a_model_dir(tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir()
    return config_error(tmp_path, with_change(lambda r: r["agents"]["solver"].update(model=str(tmp_path / "empty"))))


def refused_before_the_run(tmp_path: Path, exc_type: type[BaseException], cfg) -> str:
    """prepare_run refuses ``cfg``; nothing of the run is written (no config, no store)."""
    from flexmarl.orchestrator.runtime import prepare_run

    run_dir = tmp_path / "run"
    message = raised(exc_type, lambda: prepare_run(cfg, run_dir))
    assert not (run_dir / "config.yaml").exists() and not any((run_dir / "store").glob("*"))
    return message


def tokenizer_mismatch(tmp_path: Path) -> str:
    from flexmarl.config import load_config
    from flexmarl.models.loading import ModelError, load_tokenizer

    model = model_copy(tmp_path)
    tok = load_tokenizer(model)
    tok.add_tokens([f"<extra{i}>" for i in range(5)])  # ids beyond the embedding table
    tok.save_pretrained(model)
    cfg = load_config(preset="tiny", overrides=[f"agents.verifier.model={model}"])
    return refused_before_the_run(tmp_path, ModelError, cfg)


def cli_refuses(args: list[str]) -> str:
    """``flexmarl <args>`` exits 2 with an error before it starts a Prefect server (or a cluster); its stderr."""
    from typer.testing import CliRunner

    from flows import cli

    def no_server(*args, **kwargs):  # fault injection: reaching the Prefect step would be the bug
        raise AssertionError("the run got as far as starting a Prefect server")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("flows.prefect_server.prefect_api", no_server)
        result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    return result.stderr


def corrupt_jsonl(tmp_path: Path) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": 4}\n')
    run_dir = tmp_path / "run"
    message = cli_refuses(["train", "--preset", "tiny", "--set", f"data.path={data}", "--run-dir", str(run_dir)])
    assert not (run_dir / "config.yaml").exists() and not any((run_dir / "store").glob("*"))
    return message


# ------------------------------------------------------------------ episodes, rewards, training


def respond(node: str, traj: int) -> str:
    """Scripted agents: trajectory 0 answers right, 1 with no number at all, 2 with a 7."""
    if node.startswith("verifier"):
        return "yes"
    return {0: "so the answer is 2", 1: "I cannot say", 2: "it is 7"}[traj]


def scored_episodes(cfg, step: int = 0, input_id: str = "q0"):
    """One group of three episodes of the tiny solver -> verifier graph, generated by ``respond``, scored."""
    from flexmarl.models.tiny import build_tokenizer
    from flexmarl.rollout.backend import GenerationResult
    from flexmarl.rollout.episodes import Episode, EpisodeGraph
    from flexmarl.rollout.scoring import score
    from flexmarl.workloads.datasets import TaskItem

    tok = build_tokenizer()
    graph = EpisodeGraph(cfg, {a: tok for a in cfg.agents})
    episodes = [Episode(TaskItem(input_id, {"question": "1+1"}, "2"), j, step) for j in range(3)]
    for ep in episodes:
        ready = list(graph.roots)
        while ready:
            node = ready.pop(0)
            prompt = graph.prompt(ep, node)
            ids = tok.encode(respond(node, ep.trajectory_id), add_special_tokens=False)
            result = GenerationResult(graph.sample_id(ep, node), ids, [-1.0] * len(ids), "stop", 0)
            ready += graph.record(ep, node, prompt, result)
    score(episodes, cfg, {a: cfg.trainer_config(a) for a in cfg.agents})
    return episodes


def commit(store, cfg, episodes, seq: int) -> None:
    from flexmarl.rollout.scoring import episode_rows, sample_rows

    for agent in cfg.agents:
        store.append_samples(agent, sample_rows(episodes, agent), app_id=f"rollout:{agent}", seq=seq)
    store.append_episodes(episode_rows(episodes), app_id="rollout:episodes", seq=seq)


def reward_raises_and_output_unparsed(tmp_path: Path, monkeypatch, caplog) -> str:
    """A reward that raises on one episode, and an output that does not parse: the run records, counts, goes on."""
    from flexmarl.config import load_config
    from flexmarl.orchestrator.records import PipelineResult
    from flexmarl.orchestrator.report import build_report
    from flexmarl.orchestrator.runtime import RunContext
    from flexmarl.workloads import registry
    from flows.cli import failure_lines
    from storage.store import ExperienceStore

    correct = registry.REWARDS["correct_answer"]

    def faulty(x):  # fault injection: user reward code that breaks on one kind of output
        if x.parsed == "7":
            raise ZeroDivisionError("division by zero")
        return correct(x)

    monkeypatch.setitem(registry.REWARDS, "correct_answer", faulty)
    cfg = load_config(preset="tiny")
    with caplog.at_level(logging.WARNING, logger="flexmarl.rollout.scoring"):
        episodes = scored_episodes(cfg)
    right, unparsed, failed = episodes
    assert failed.error is not None and right.error is None and unparsed.error is None
    assert right.outputs["solver"].reward == 1.0
    assert unparsed.outputs["solver"].parsed is None and unparsed.outputs["solver"].reward == 0.0
    assert all(o.reward is None for o in failed.outputs.values())  # not trained on

    store = ExperienceStore(tmp_path / "store")
    store.create(cfg.agents)
    commit(store, cfg, episodes, seq=1)
    status = dict(zip(*store.read_samples("solver", columns=["sample_id", "status"]).to_pydict().values()))
    assert status == {"q0_0_0": "rewarded", "q0_0_1": "rewarded", "q0_0_2": "generated"}
    ctx = RunContext("r", str(tmp_path), store.root, "tcp://127.0.0.1:1")
    report = build_report(ctx, cfg, PipelineResult(0.0, 1.0, [], [], ["w"], 0), wall_s=1.0)
    assert report["episodes_failed"] == 1 and report["agents"]["solver"]["samples_unparsed"] == 1
    return "\n".join([*caplog.messages, *failure_lines(report)])


def nan_loss(tmp_path: Path, caplog) -> str:
    from flexmarl.models.loading import resolve_model
    from flexmarl.training.config import TrainerConfig
    from flexmarl.training.trainer import AgentTrainer, TrainBatch

    trainer = AgentTrainer("solver", resolve_model("tiny"), TrainerConfig(lr=1e-3), temperature=1.0)
    before = {k: v.clone() for k, v in trainer.weights().items()}
    batch = TrainBatch(["s0", "s1"], [[257, 10], [257, 11]], [[20, 21], [22]], [[-1.0, -1.0], [-1.0]],
                       [float("nan"), 1.0], [0, 0])
    with caplog.at_level(logging.WARNING, logger="flexmarl.training.trainer"):
        result = trainer.train_step(batch)
    assert result.skipped and result.consumed_ids == [] and result.policy_version == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.weights().items())
    return "\n".join(caplog.messages)


def weight_update_mismatch(tmp_path: Path) -> str:
    from flexmarl.models.loading import resolve_model
    from flexmarl.rollout.backend import WeightSyncError, WeightUpdate
    from flexmarl.rollout.hf_backend import HFBackend

    backend = HFBackend(resolve_model("tiny"))
    state = dict(backend.model.state_dict())
    state[next(iter(state))] = torch.zeros(3, 3)
    return raised(WeightSyncError, lambda: backend.update_weights(WeightUpdate("solver", 1, state)))


# ------------------------------------------------------------------ the store


def committed_store(tmp_path: Path):
    """A run directory whose store holds two committed steps and an update of each agent."""
    from flexmarl.config import load_config
    from flexmarl.orchestrator.runtime import prepare_run
    from storage.store import ExperienceStore

    cfg = load_config(preset="tiny")
    run_dir = tmp_path / "run"
    _, uri = prepare_run(cfg, run_dir)
    store = ExperienceStore(uri)
    for step in range(2):
        commit(store, cfg, scored_episodes(cfg, step, f"q{step}"), seq=step + 1)
    for agent in cfg.agents:
        store.record_update(agent, 1, [f"q0_{0 if agent == 'solver' else 1}_0"], samples_version=1, num_tokens=3)
    return cfg, run_dir, store


def snapshot(store) -> dict:
    """Every table's rows, for 'nothing committed was lost' checks."""
    return {t: store.read(t).drop_columns(["created_at"]).sort_by(store.read(t).column_names[0]).to_pylist()
            for t in store.tables()}


def unwritable_run_dir(tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("")
    return cli_refuses(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "a-file" / "x")])


def unwritable_store(tmp_path: Path) -> str:
    from flexmarl.config import load_config
    from flexmarl.orchestrator.runtime import RunSetupError, prepare_run

    cfg, run_dir, store = committed_store(tmp_path)
    before, config_before = snapshot(store), (run_dir / "config.yaml").read_text()
    (tmp_path / "a-file").write_text("")
    bad = load_config(preset="tiny", overrides=[f"store.uri={tmp_path / 'a-file' / 'store'}"])
    message = raised(RunSetupError, lambda: prepare_run(bad, run_dir))  # the same run directory, another store
    assert snapshot(store) == before and (run_dir / "config.yaml").read_text() == config_before
    return message


def corrupted_delta_log(tmp_path: Path) -> str:
    from storage.verify import verify_store

    _, _, store = committed_store(tmp_path)
    before = snapshot(store)
    (Path(store.table_uri("samples/verifier")) / "_delta_log" / f"{2:020d}.json").write_text("{not json")
    files = sorted(p.relative_to(store.root) for p in Path(store.root).rglob("*"))
    (bad,) = [v for v in verify_store(store) if v.check == "unreadable"]
    assert sorted(p.relative_to(store.root) for p in Path(store.root).rglob("*")) == files  # verify wrote nothing
    for table in ("samples/solver", "episodes", "updates"):  # the other tables keep every committed row
        rows = store.read(table)
        assert rows.drop_columns(["created_at"]).sort_by(rows.column_names[0]).to_pylist() == before[table]
    return f"{bad.table}: {bad.detail}"


def not_a_store(tmp_path: Path) -> str:
    from storage.store import ExperienceStore, StoreError

    return raised(StoreError, lambda: ExperienceStore(tmp_path).open("updates"))


# ------------------------------------------------------------------ the cluster and the Prefect API


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_worker_resource(tmp_path: Path) -> str:
    from distributed import Client, LocalCluster

    from flexmarl.cluster.local import ClusterError, workers_offering

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                      resources={"rollout": 1}) as cluster, Client(cluster) as client:
        return raised(ClusterError, lambda: workers_offering(client, "GPU", "training"))


def dask_unreachable(tmp_path: Path) -> str:
    from flexmarl.cluster.local import ClusterError, connect

    return raised(ClusterError, lambda: connect(f"tcp://127.0.0.1:{free_port()}", timeout_s=2))


def dask_without_workers(tmp_path: Path) -> str:
    from distributed import LocalCluster

    from flexmarl.cluster.local import ClusterError, connect

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        return raised(ClusterError, lambda: connect(cluster.scheduler_address, timeout_s=1))


def prefect_unreachable(tmp_path: Path) -> str:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.prefect_server import PrefectAPIError, prefect_api

    def start() -> None:
        with prefect_api():
            pass

    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        return raised(PrefectAPIError, start)


def prefect_silent(tmp_path: Path) -> str:
    """An API that accepts connections and never answers: the health check gives up at its bound."""
    from flows.prefect_server import PrefectAPIError, check_api

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        return raised(PrefectAPIError, lambda: check_api(url, timeout_s=1))


def too_many_slots(tmp_path: Path) -> str:
    from flexmarl.orchestrator.runtime import training_slots

    return raised(ValueError, lambda: training_slots(3, ["tcp://a:1", "tcp://b:1"]))


# ------------------------------------------------------------------ the table

CONFIG = "tests/flexmarl/meg/test_spec.py"
GRAPH = "tests/flexmarl/meg/test_graph.py"

CASES = [
    Case("malformed-yaml", lambda t: config_error(t, text="agents:\n  solver: {model: tiny\n  verifier: x\n"),
         (r"run.yaml: malformed YAML at line 3, column \d+", "fix the YAML syntax there"),
         f"{CONFIG}::test_malformed_yaml_gives_the_line"),
    Case("not-a-mapping", lambda t: config_error(t, text="- solver\n- verifier\n"),
         (r"the top level must be a mapping of settings \(agents:, graph:, ...\), got list",
          "start from a preset")),
    Case("missing-config-file", missing_config, (r"cannot read config .*nope.yaml: No such file", "check the path")),
    Case("unknown-preset", unknown_preset, (r"unknown preset 'tinny' \(did you mean 'tiny'\?\)", "presets:")),
    Case("bad-override", bad_override, ("override 'train.steps' must look like dotted.key=value",)),
    Case("unknown-key", lambda t: config_error(t, overrides=("train.stepz=3",)),
         (r"train.stepz: unknown key \(did you mean 'steps'\?\)", "valid keys here: .*'steps'"),
         f"{CONFIG}::test_unknown_key_suggests_the_nearest"),
    Case("wrong-type", lambda t: config_error(t, overrides=("train.steps=many",)),
         (r"train.steps: Input should be a valid integer.*\(got 'many'\)", "docs/configuration.md lists every key"),
         f"{CONFIG}::test_wrong_type_names_the_field"),
    Case("out-of-range", lambda t: config_error(t, overrides=("training.lr=-1",)),
         (r"training.lr: Input should be greater than 0 \(got -1\)",)),
    Case("partial-group-micro-batch", lambda t: config_error(t, overrides=("training.micro_batch_size=6",)),
         (r"training.micro_batch_size=6 is not a whole number of GRPO groups of agent 'solver': one query gives it "
          r"4 samples \(train.group_size=4 x 1 node\(s\)\)", r"use 4 \(or another multiple of 4\), or set "
          r"agents.solver.training.micro_batch_size")),
    Case("cyclic-graph",
         lambda t: config_error(t, with_change(lambda r: r["graph"]["edges"].append(["verifier", "solver"]))),
         (r"cycle \((solver -> verifier -> solver|verifier -> solver -> verifier)\)",
          r"graph.loops like \{nodes: \[solver, verifier\], max_turns: 3\}"),
         f"{GRAPH}::test_graph_errors_name_the_declared_nodes_and_the_fix"),
    Case("missing-template-field",
         lambda t: config_error(t, with_change(lambda r: r["agents"]["verifier"].update(prompt="{question} {plan}"))),
         (r"node 'verifier' \(agent 'verifier'\): prompt field\(s\) \['plan'\] are provided by neither",
          r"fix agents.verifier.prompt, or add an edge \[<parent>, verifier\]"),
         f"{CONFIG}::test_template_field_no_parent_provides"),
    Case("unknown-agent",
         lambda t: config_error(t, with_change(lambda r: r["graph"]["nodes"][1].update(agent="verifer"))),
         (r"node 'verifier' uses unknown agent 'verifer' \(did you mean 'verifier'\?\)", "declare it under agents"),
         f"{CONFIG}::test_unknown_agent_in_a_node"),
    Case("unused-agent",
         lambda t: config_error(t, with_change(lambda r: r["agents"].update(judge=r["agents"]["verifier"]))),
         (r"agents \['judge'\] are declared but no graph node uses them", "remove them or add a node")),
    Case("unknown-node",
         lambda t: config_error(t, with_change(lambda r: r["graph"]["edges"].append(["solver", "verifer"]))),
         (r"edge \[solver, verifer\] names unknown node 'verifer' \(did you mean 'verifier'\?\)", "nodes are")),
    Case("duplicate-node",
         lambda t: config_error(t, with_change(lambda r: r["graph"]["nodes"].append(r["graph"]["nodes"][0]))),
         (r"duplicate node names \['solver'\]", "give every node its own name")),
    Case("bad-name",
         lambda t: config_error(t, with_change(lambda r: r["agents"].update(Solver=r["agents"].pop("solver")))),
         ("agent name 'Solver' must be lower case letters, digits and '_'",)),
    Case("unregistered-function", lambda t: config_error(t, overrides=("agents.solver.reward=os.system",)),
         (r"agents.solver.reward: unknown reward 'os.system'", "never import paths",
          "list it in flexmarl/workloads/registry.py"),
         f"{CONFIG}::test_unregistered_reward_is_refused"),
    Case("reward-needs-task-field", lambda t: config_error(t, overrides=("agents.solver.reward=passes_tests",)),
         (r"'passes_tests' reads task field\(s\) \['entry_point'\], which this data does not provide",
          "use data.dataset: humaneval, or another reward"),
         "tests/flexmarl/workloads/test_code_workload.py::test_a_code_reward_on_data_without_code_is_refused"),
    Case("bad-dask-address", lambda t: config_error(t, overrides=("cluster.address=localhost",)),
         (r"cluster.address: 'localhost' is not a Dask scheduler address", "write it as tcp://host:8786")),
    Case("missing-model",
         lambda t: config_error(t, with_change(lambda r: r["agents"]["solver"].update(model=str(t / "no-model")))),
         (r"agents.solver.model: model path '.*no-model' does not exist", "a local Hugging Face model directory"),
         f"{CONFIG}::test_missing_model_path"),
    Case("not-a-model-directory", not_a_model_dir,
         (r"model directory '.*empty' has no config.json", "give a Hugging Face model directory")),
    Case("pickled-weights", pickled_weights,
         (r"holds only pickled weights \(pytorch_model.bin\), which FlexMARL never loads",
          "save_pretrained\\(dir, safe_serialization=True\\)")),
    Case("tokenizer-mismatch", tokenizer_mismatch,
         (r"the tokenizer .*model/tokenizer.json has 264 tokens but the model .*model/config.json has an "
          r"embedding table of 259 rows", "copy the model's own tokenizer files"),
         "tests/flexmarl/models/test_loading.py::test_tokenizer_larger_than_the_embedding_table_is_refused"),
    Case("missing-data-file", lambda t: config_error(t, overrides=(f"data.path={t / 'nope.jsonl'}",)),
         (r"data file .*nope.jsonl does not exist", "set data.path to a GSM8K-style JSONL file"),
         "tests/flexmarl/workloads/test_workloads.py::test_missing_data_file"),
    Case("corrupt-jsonl-line", corrupt_jsonl,
         (r"data.jsonl:2: not a JSON object with 'question' and 'answer'", "fix or remove that line"),
         "tests/flexmarl/workloads/test_workloads.py::test_corrupt_jsonl_line_is_named"),
    Case("reward-raises", lambda t: "",  # filled by test_reward_failures_and_unparsed_outputs
         (r"episode q0_2 failed, the run goes on without its samples: reward 'correct_answer' of node 'solver' "
          r"failed: ZeroDivisionError", "fix that reward function",
          r"1 episode\(s\) failed because a reward function raised")),
    Case("unparsable-output", lambda t: "",  # filled by test_reward_failures_and_unparsed_outputs
         (r"solver: 1 of 3 outputs did not parse \(rewarded 0", "check agents.solver.parser and its prompt")),
    Case("nan-loss", lambda t: "",  # filled by test_nan_loss
         (r"agent 'solver': the update to v1 is skipped, weights untouched: loss nan", "lower training.lr"),
         "tests/flexmarl/training/test_trainer.py::test_nan_loss_skips_the_update"),
    Case("weight-update-mismatch", weight_update_mismatch,
         (r"weight update v1 for agent 'solver' does not match the replica's model.*got \(3, 3\)",
          "must load the same model directory"),
         "tests/flexmarl/rollout/test_hf_backend.py::test_weight_update_is_validated_before_it_is_applied"),
    Case("unwritable-run-dir", unwritable_run_dir,
         (r"error: cannot write the run directory .*a-file/x: Not a directory", "choose another --run-dir")),
    Case("unwritable-store", unwritable_store,
         (r"cannot write the store .*a-file/store: Not a directory", "set store.uri to a writable directory")),
    Case("corrupted-delta-log", corrupted_delta_log,
         ("samples/verifier: the Delta log fails to load at version 2", "restore that commit file"),
         "tests/storage/test_verify.py::test_a_corrupted_log_names_the_table_and_the_version"),
    Case("not-a-store", not_a_store,
         (r"no Delta table 'updates' under .*: is this a FlexMARL store", "Give a run directory"),
         "tests/flows/test_store_cli.py::test_verify_refuses_a_path_that_is_not_a_store"),
    Case("missing-worker-resource", missing_worker_resource,
         (r"no Dask worker offers resource 'GPU' for training \(workers offer: \['rollout'\]\)",
          r"start workers with `--resources \"GPU=1\"` or set cluster.worker_resources"),
         "tests/flexmarl/orchestrator/test_pipeline.py::test_a_resource_no_worker_offers_is_a_clear_error"),
    Case("too-many-slots", too_many_slots,
         (r"training.slots=3 but only 2 training worker\(s\) exist", "lower training.slots")),
    Case("dask-unreachable", dask_unreachable,
         (r"cannot reach the Dask scheduler at tcp://127.0.0.1:\d+ within 2s \(Connection refused\)",
          "check cluster.address")),
    Case("dask-without-workers", dask_without_workers,
         (r"the Dask scheduler at \S+ has no workers after 1s", "start workers with `dask worker")),
    Case("prefect-unreachable", prefect_unreachable,
         (r"the Prefect API at http://127.0.0.1:\d+/api does not answer",
          "start it with `prefect server start` or unset PREFECT_API_URL")),
    Case("prefect-silent", prefect_silent,
         (r"the Prefect API at http://127.0.0.1:\d+/api does not answer \(no answer within 1s\)",)),
]
BY_ID = {c.id: c for c in CASES}
FILLED_ELSEWHERE = {"reward-raises", "unparsable-output", "nan-loss"}


# ------------------------------------------------------------------ the documented messages


def documented() -> dict[str, list[str]]:
    """docs/errors.md's rows by test id: the messages of the row (its ````...```` spans)."""
    rows = {}
    for line in ERRORS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or cells[0] == "kind" or set(cells[0]) <= set("-: "):
            continue
        rows[cells[4].strip("`")] = re.findall(r"``\s?(.*?)\s?``", cells[1])
    return rows


def message_pattern(template: str) -> re.Pattern:
    """A documented message as a pattern: ``<placeholder>`` stands for any text."""
    parts = re.split(r"<[a-z0-9 _-]+>", template)
    escaped = [re.escape(p).replace("\\ ", r"\s+") for p in parts]  # the printed message may wrap lines
    return re.compile(".+?".join(escaped), re.DOTALL)


def check(case: Case, message: str) -> None:
    for pattern in case.expect:
        assert re.search(pattern, message, re.DOTALL), f"{case.id}: {pattern!r} not in:\n{message}"
    spans = documented().get(case.id)
    assert spans, f"{case.id} has no row (with a ``message``) in docs/errors.md"
    for span in spans:
        assert message_pattern(span).search(message), f"{case.id}: docs/errors.md says {span!r}; printed:\n{message}"


@pytest.mark.parametrize("case", [c for c in CASES if c.id not in FILLED_ELSEWHERE], ids=lambda c: c.id)
def test_bad_input_is_named_with_its_fix(case: Case, tmp_path: Path) -> None:
    check(case, case.trigger(tmp_path))


def test_reward_failures_and_unparsed_outputs(tmp_path: Path, monkeypatch, caplog) -> None:
    message = reward_raises_and_output_unparsed(tmp_path, monkeypatch, caplog)
    check(BY_ID["reward-raises"], message)
    check(BY_ID["unparsable-output"], message)


def test_nan_loss(tmp_path: Path, caplog) -> None:
    check(BY_ID["nan-loss"], nan_loss(tmp_path, caplog))


def test_every_documented_kind_has_a_test_and_every_case_is_documented() -> None:
    rows = documented()
    assert len(rows) >= 20
    missing_docs = sorted(set(BY_ID) - set(rows))
    assert not missing_docs, f"cases without a row in docs/errors.md: {missing_docs}"
    for test_id in rows:
        if test_id in BY_ID:
            continue
        path, _, function = test_id.partition("::")
        assert (ROOT / path).is_file() and re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), (
            f"docs/errors.md names {test_id}, which is neither a case here nor a test function"
        )
    for case in CASES:
        if case.see:
            path, _, function = case.see.partition("::")
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), case.see
