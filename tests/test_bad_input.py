"""Every kind of bad input FlexMARL refuses or survives: one case each, asserting the message a user sees.

A case triggers the problem with real components (config files, model directories, Delta tables, a Dask
scheduler, an HTTP socket) and returns the message; the test checks that it names the problem and the fix.
The store cases also check that committed data is intact afterwards. ``docs/errors.md`` lists the same kinds:
its ``test`` column holds a case id here (or a deeper test), and its message column must match the message
the case produced. ``see`` names the deeper test of the same behaviour, where there is one.
"""

from __future__ import annotations

import http.server
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


def preflight_error(tmp_path: Path, *overrides: str) -> str:
    from flexmarl.config import ConfigError, load_config
    from flexmarl.preflight import check_inputs

    return raised(ConfigError, lambda: check_inputs(load_config(preset="tiny", overrides=list(overrides))))


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

    return raised(ConfigError, lambda: load_config(preset="tiny", overrides=["run.steps"]))


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
    from flexmarl.run.prepare import prepare_run

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
    from flexmarl.workloads.datasets import Problem

    tok = build_tokenizer()
    graph = EpisodeGraph(cfg, {a: tok for a in cfg.agents})
    episodes = [Episode(Problem(input_id, {"question": "1+1"}, "2"), j, step) for j in range(3)]
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
    from flexmarl.run.prepare import prepare_run
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
    from flexmarl.preflight import RunLocationError
    from flexmarl.run.prepare import prepare_run

    cfg, run_dir, store = committed_store(tmp_path)
    before, config_before = snapshot(store), (run_dir / "config.yaml").read_text()
    (tmp_path / "a-file").write_text("")
    bad = load_config(preset="tiny", overrides=[f"store.uri={tmp_path / 'a-file' / 'store'}"])
    message = raised(RunLocationError, lambda: prepare_run(bad, run_dir))  # the same run directory, another store
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


def not_a_run_dir(tmp_path: Path) -> str:
    from flexmarl.config import ConfigError
    from flexmarl.evaluate import plan_evaluation

    return raised(ConfigError, lambda: plan_evaluation(tmp_path, 4))


def run_without_checkpoints(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(tiny_raw()))
    return tmp_path / "run"


def no_checkpoints(tmp_path: Path) -> str:
    from flexmarl.config import ConfigError
    from flexmarl.evaluate import plan_evaluation

    return raised(ConfigError, lambda: plan_evaluation(run_without_checkpoints(tmp_path), 4))


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


def too_many_slots(tmp_path: Path, slots: int | None = 3, sharded: dict[str, int] | None = None) -> str:
    from flexmarl.cluster.local import ClusterError
    from flexmarl.orchestrator.runtime import training_slots

    return raised(ClusterError, lambda: training_slots(slots, ["tcp://a:1", "tcp://b:1"], sharded))


# ------------------------------------------------------------------ checked before the run (flexmarl.preflight)


def inputs_error(tmp_path: Path, exc_type: type[BaseException], overrides: list[str]) -> str:
    """``check_inputs`` (what validate and train run before anything starts) refuses the tiny preset with
    ``overrides``."""
    from flexmarl.config import load_config
    from flexmarl.preflight import check_inputs

    cfg = load_config(preset="tiny", overrides=overrides)
    return raised(exc_type, lambda: check_inputs(cfg))


def data_error(tmp_path: Path, overrides: list[str]) -> str:
    from flexmarl.workloads.datasets import DataError

    return inputs_error(tmp_path, DataError, overrides)


def jsonl_error(tmp_path: Path, text: str) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text(text)
    return data_error(tmp_path, [f"data.path={data}"])


def fake_gguf(tmp_path: Path) -> str:
    from flexmarl.models.loading import ModelError

    model = tmp_path / "model.gguf"
    model.write_text("<html>not found</html>")  # what a failed download often leaves
    return inputs_error(tmp_path, ModelError, [f"agents.solver.model={model}"])


def damaged_safetensors(tmp_path: Path) -> str:
    from flexmarl.models.loading import ModelError

    model = model_copy(tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    return inputs_error(tmp_path, ModelError, [f"agents.solver.model={model}"])


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # its request log would go to the stderr the test reads
        pass


def not_a_dask_scheduler(tmp_path: Path) -> str:
    """An HTTP server where the scheduler should be: refused within the bound, not waited on forever."""
    import threading

    from flexmarl.cluster.local import ClusterError, connect

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return raised(ClusterError, lambda: connect(f"tcp://127.0.0.1:{server.server_port}", timeout_s=2))
    finally:
        server.shutdown()
        server.server_close()


HOLD_LOCK = """
import sys, time
from flexmarl.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def held_by_another_process(run_dir: Path):
    """A real second process holding the run directory's lock (an OS lock is per process)."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def run_dir_in_use(tmp_path: Path) -> str:
    from flexmarl.run_lock import RunLockError, run_lock

    run_dir = tmp_path / "run"
    holder = held_by_another_process(run_dir)
    try:
        def take() -> None:
            with run_lock(run_dir):
                pass

        message = raised(RunLockError, take)
        assert str(holder.pid) in message
        return message
    finally:
        holder.kill()
        holder.wait()


def missing_delta_commit(tmp_path: Path) -> str:
    from storage.verify import verify_store

    _, _, store = committed_store(tmp_path)
    (Path(store.table_uri("samples/verifier")) / "_delta_log" / f"{1:020d}.json").unlink()
    (bad,) = [v for v in verify_store(store) if v.check == "unreadable"]
    return f"{bad.table}: {bad.detail}"


def resume_fails_verify(tmp_path: Path) -> str:
    """A resume of a run whose store fails verify is refused, naming the problem and the repair."""
    from flexmarl.config import load_config
    from flexmarl.run_start import ResumeRefused, check_resumable

    cfg, run_dir, store = committed_store(tmp_path)
    (Path(store.table_uri("samples/solver")) / "_delta_log" / f"{1:020d}.json").unlink()
    return raised(ResumeRefused, lambda: check_resumable(load_config(run_dir / "config.yaml"), run_dir))


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
    Case("bad-override", bad_override, ("override 'run.steps' must look like dotted.key=value",)),
    Case("unknown-key", lambda t: config_error(t, overrides=("run.stepz=3",)),
         (r"run.stepz: unknown key \(did you mean 'steps'\?\)", "valid keys here: .*'steps'"),
         f"{CONFIG}::test_unknown_key_suggests_the_nearest"),
    Case("renamed-key", lambda t: config_error(t, overrides=("train.steps=3",)),
         (r"override 'train.steps=3': train is now run: write run.steps",)),
    Case("renamed-section", lambda t: config_error(t, text="train: {steps: 3}\n"),
         (r"the section 'train:' is now 'run:'; rename it \(its keys keep their names\)",)),
    Case("wrong-type", lambda t: config_error(t, overrides=("run.steps=many",)),
         (r"run.steps: Input should be a valid integer.*\(got 'many'\)", "docs/configuration.md lists every key"),
         f"{CONFIG}::test_wrong_type_names_the_field"),
    Case("out-of-range", lambda t: config_error(t, overrides=("training.lr=-1",)),
         (r"training.lr: Input should be greater than 0 \(got -1\)",)),
    Case("partial-group-micro-batch", lambda t: config_error(t, overrides=("training.micro_batch_size=6",)),
         (r"training.micro_batch_size=6 is not a whole number of GRPO groups of agent 'solver': one query gives it "
          r"4 samples \(run.group_size=4 x 1 node\(s\)\)", r"use 4 \(or another multiple of 4\), or set "
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
    Case("reward-needs-problem-field", lambda t: config_error(t, overrides=("agents.solver.reward=passes_tests",)),
         (r"'passes_tests' reads problem field\(s\) \['entry_point'\], which this data does not provide",
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
    Case("not-a-run-dir", not_a_run_dir, (r"is not a run directory \(no config.yaml\)", "give a directory")),
    Case("no-checkpoints", no_checkpoints,
         (r"has no checkpoint of \['solver', 'verifier'\]", "train the run first, or continue it")),
    Case("not-a-store", not_a_store,
         (r"no Delta table 'updates' under .*: is this a FlexMARL store", "Give a run directory"),
         "tests/flows/test_store_cli.py::test_verify_refuses_a_path_that_is_not_a_store"),
    Case("missing-worker-resource", missing_worker_resource,
         (r"no Dask worker offers resource 'GPU' for training \(workers offer: \['rollout'\]\)",
          r"start workers with `--resources \"GPU=1\"` or set cluster.worker_resources"),
         "tests/flexmarl/orchestrator/test_pipeline.py::test_a_resource_no_worker_offers_is_a_clear_error"),
    Case("state-over-memory-limit", lambda t: preflight_error(t, "cluster.memory_limit=2MB"),
         (r"agents.solver: its training state needs at least 3.21 MiB \(24 bytes per parameter.*but a worker's "
          r"memory limit is 1.91 MiB \(cluster.memory_limit='2MB' over 2 workers\)", "raise cluster.memory_limit",
          r"or shard it over several slots \(agents.solver.training.sharding: 'full', or 'optimizer'")),
    Case("sharded-state-over-memory-limit",
         lambda t: preflight_error(t, "cluster.memory_limit=2MB", "training.sharding=full", "training.max_slots=2",
                                   "agents.verifier.training.sharding=none"),
         (r"agents.solver: its training state, sharded \('full'\) over 2 ranks, needs at least 2.14 MiB on each",
          r"or shard it over more slots \(training.max_slots\)")),
    Case("zero-state-over-memory-limit",
         lambda t: preflight_error(t, "cluster.memory_limit=2MB", "training.sharding=optimizer",
                                   "training.max_slots=2", "agents.verifier.training.sharding=none"),
         (r"agents.solver: its training state, sharded \('optimizer'\) over 2 ranks, needs at least 2.67 MiB on each",
          r"or all of it \(training.sharding: 'full'\)")),
    Case("sharded-shares-over-memory-limit",
         lambda t: preflight_error(t, "cluster.memory_limit=3MB", "training.sharding=full", "training.max_slots=2"),
         (r"agents solver, verifier: sharded over the same ranks, their shares add up to at least 4.27 MiB on each "
          r"rank \(solver 2.14 MiB, verifier 2.14 MiB\)", r"or shard fewer of them")),
    Case("sharded-agents-span-differently",
         lambda t: config_error(t, overrides=("training.sharding=full", "training.max_slots=2",
                                              "agents.verifier.training.max_slots=3")),
         (r"sharded agents span different numbers of slots \(solver over 2, verifier over 3\)",
          r"give them the same training.max_slots")),
    Case("sharded-adapter",
         lambda t: config_error(t, overrides=("agents.solver.training.sharding=full", "agents.solver.adapter={r: 4}")),
         (r"agents.solver: an adapter agent's trainer is not sharded", r"use training.sharding='none' for it")),
    Case("sharded-over-more-slots", lambda t: too_many_slots(t, None, {"solver": 3}),
         (r"agent 'solver' is sharded over training.max_slots=3 slots but only 2 training slot\(s\) exist",
          "lower agents.solver.training.max_slots")),
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
    Case("bad-override-value", lambda t: config_error(t, overrides=("run.steps=[",)),
         (r"override 'run.steps=\[': the value is not valid YAML", "quote it")),
    Case("bad-memory-limit", lambda t: config_error(t, overrides=("cluster.memory_limit=lots",)),
         (r"cluster.memory_limit: 'lots' is not a memory size", "write a size such as '6GiB'")),
    Case("template-does-not-parse",
         lambda t: config_error(t, with_change(lambda r: r["agents"]["verifier"].update(prompt="{solver} {question"))),
         (r"agents.verifier.prompt: the prompt template does not parse \(expected '}' before end of string\)",
          r"close every \{field\}, or write a literal brace as \{\{ or \}\}")),
    Case("template-field-not-a-name",
         lambda t: config_error(t, with_change(lambda r: r["agents"]["solver"].update(prompt="{question.__class__}"))),
         (r"agents.solver.prompt: the prompt template has the field \{question.__class__\}",
          r"a field is a plain name such as \{question\}")),
    Case("unknown-dataset", lambda t: data_error(t, ["data.dataset=gsm_symbolc", "data.dataset_args={}"]),
         (r"data.dataset: unknown dataset 'gsm_symbolc' \(did you mean 'gsm_symbolic'\?\)",
          r"one of reasoning-gym's: .*basic_arithmetic.*gsm_symbolic")),
    Case("unknown-dataset-argument", lambda t: data_error(t, ["data.dataset_args.max_termz=3"]),
         (r"data.dataset_args: \['max_termz'\] is not an argument of the 'basic_arithmetic' dataset \(did you mean "
          r"'max_terms'\?\)", "its arguments: .*max_terms")),
    Case("dataset-refuses-arguments", lambda t: data_error(t, ["data.dataset_args.max_terms=1"]),
         (r"data.dataset_args: reasoning-gym refuses 'basic_arithmetic' with .*max_terms must be >= min_terms",
          "change those arguments")),
    Case("empty-jsonl", lambda t: jsonl_error(t, "\n"),
         (r"data file .*data.jsonl holds no problems", "give one JSON object per line")),
    Case("jsonl-answer-without-number",
         lambda t: jsonl_error(t, '{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": "four"}\n'),
         (r"data.jsonl:2: the answer has no final number \(it ends 'four'\)", "end each answer with '#### <number>'")),
    Case("not-a-gguf-file", fake_gguf,
         (r"agents.solver.model: model file '.*model.gguf' is not a GGUF file", "give a complete .gguf file")),
    Case("damaged-safetensors", damaged_safetensors,
         (r"agents.solver.model: model weights .*model.safetensors do not parse as safetensors",
          "copy it again, or write the model again with save_pretrained")),
    Case("not-a-dask-scheduler", not_a_dask_scheduler,
         (r"the service at tcp://127.0.0.1:\d+ does not answer as a Dask scheduler within 2s",
          "check cluster.address")),
    Case("run-dir-in-use", run_dir_in_use,
         (r"run is in use by process \d+ on \S+ \(flexmarl train, started .*\)",
          r"wait for that run to end, or stop it \(kill \d+\) and resume with `flexmarl train --resume",
          "or choose another --run-dir")),
    Case("missing-delta-commit", missing_delta_commit,
         (r"samples/verifier: the Delta log is missing commit 1 \(00000000000000000001.json in _delta_log\)",
          "restore that commit file from a backup; versions before 1 still read"),
         "tests/storage/test_verify.py::test_a_missing_commit_is_named_not_the_one_after_it"),
    Case("resume-fails-verify", resume_fails_verify,
         (r"cannot resume .*run: its store fails verify: unreadable in samples/solver: the Delta log is missing "
          r"commit 1", "a resumed run would train on it", "Restore the store from a backup")),
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


# ------------------------------------------------------------------ every documented error, through the CLI
#
# Each row of docs/errors.md that a user can meet on the command line is triggered here through `flexmarl ...`
# (typer's runner, in this process): it must exit with code 2, print the row's message, and no traceback.
# A row that only happens during a run is listed in DURING_A_RUN with the reason; no row may be in neither.


def documented_rows() -> dict[str, list[str]]:
    """docs/errors.md's rows by kind (the first cell): the messages of the row."""
    rows = {}
    for line in ERRORS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or cells[0] == "kind" or set(cells[0]) <= set("-: "):
            continue
        rows[cells[0]] = re.findall(r"``\s?(.*?)\s?``", cells[1])
    return rows


def tiny_file(tmp_path: Path, change: Callable[[dict], None]) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(with_change(change)))
    return str(path)


def text_file(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def validate_tiny(*overrides: str) -> list[str]:
    return ["validate", "--preset", "tiny", *[a for o in overrides for a in ("--set", o)]]


def train_tiny(tmp_path: Path, *args: str) -> list[str]:
    return ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "new-run"), *args]


def tokenizer_mismatch_model(tmp_path: Path) -> str:
    from flexmarl.models.loading import load_tokenizer

    model = model_copy(tmp_path)
    tok = load_tokenizer(model)
    tok.add_tokens([f"<extra{i}>" for i in range(5)])
    tok.save_pretrained(model)
    return str(model)


def pickled_model(tmp_path: Path) -> str:
    model = model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    return str(model)


def fake_gguf_file(tmp_path: Path) -> str:
    return text_file(tmp_path, "<html>not found</html>", "model.gguf")


def truncated_weights(tmp_path: Path) -> str:
    model = model_copy(tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return str(model)


def damaged_run(tmp_path: Path, damage: Callable[[Path, object], None]) -> list[str]:
    """A run with two committed steps, damaged, then resumed."""
    _, run_dir, store = committed_store(tmp_path)
    damage(run_dir, store)
    return ["train", "--resume", str(run_dir)]


def delete_commit(table: str, version: int) -> Callable[[Path, object], None]:
    return lambda run_dir, store: (Path(store.table_uri(table)) / "_delta_log" / f"{version:020d}.json").unlink()


def corrupt_commit(run_dir: Path, store) -> None:
    (Path(store.table_uri("samples/verifier")) / "_delta_log" / f"{2:020d}.json").write_text("{not json")


def in_use(tmp_path: Path, stack) -> list[str]:
    holder = held_by_another_process(tmp_path / "new-run")
    stack.callback(holder.wait)
    stack.callback(holder.kill)
    return train_tiny(tmp_path)


def http_server(stack) -> int:
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return server.server_port


def scheduler_without_workers(stack) -> str:
    from distributed import LocalCluster

    cluster = stack.enter_context(LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                                               dashboard_address=None))
    return cluster.scheduler_address


def prefect_at(stack, url: str) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    stack.enter_context(temporary_settings({PREFECT_API_URL: url}))


def silent_listener(stack) -> int:
    listener = stack.enter_context(socket.socket())
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener.getsockname()[1]


def edge(parent: str, child: str) -> Callable[[dict], None]:
    return lambda r: r["graph"]["edges"].append([parent, child])


# kind (docs/errors.md's first cell) -> (tmp_path, exit stack) -> the flexmarl arguments
CLI_CASES: dict[str, Callable] = {
    "malformed YAML": lambda t, s: ["validate", text_file(t, "agents:\n  solver: {model: tiny\n  verifier: x\n")],
    "not a mapping": lambda t, s: ["validate", text_file(t, "- solver\n- verifier\n")],
    "missing config file": lambda t, s: ["validate", str(t / "nope.yaml")],
    "unknown preset": lambda t, s: ["validate", "--preset", "tinny"],
    "not a run directory": lambda t, s: ["evaluate", str(t)],
    "a run without checkpoints": lambda t, s: ["evaluate", str(run_without_checkpoints(t))],
    "bad `--set`": lambda t, s: validate_tiny("run.steps"),
    "`--set` value that is not YAML": lambda t, s: validate_tiny("run.steps=["),
    "unknown key": lambda t, s: validate_tiny("run.stepz=3"),
    "renamed key": lambda t, s: validate_tiny("train.steps=3"),
    "renamed section": lambda t, s: ["validate", text_file(t, "train: {steps: 3}\n")],
    "wrong type": lambda t, s: validate_tiny("run.steps=many"),
    "value out of range": lambda t, s: validate_tiny("training.lr=-1"),
    "memory size": lambda t, s: train_tiny(t, "--set", "cluster.memory_limit=lots"),
    "training state over a worker's memory": lambda t, s: train_tiny(t, "--set", "cluster.memory_limit=2MB"),
    "cyclic graph": lambda t, s: ["validate", tiny_file(t, edge("verifier", "solver"))],
    "template field no parent provides": lambda t, s: validate_tiny('agents.verifier.prompt="{question} {plan}"'),
    "template that does not parse": lambda t, s: ["validate", tiny_file(
        t, lambda r: r["agents"]["verifier"].update(prompt="{solver} {question"))],
    "template field that is not a name": lambda t, s: validate_tiny('agents.solver.prompt="{question.__class__}"'),
    "unknown agent": lambda t, s: ["validate", tiny_file(t, lambda r: r["graph"]["nodes"][1].update(agent="verifer"))],
    "unused agent": lambda t, s: ["validate",
                                  tiny_file(t, lambda r: r["agents"].update(judge=r["agents"]["verifier"]))],
    "unknown node": lambda t, s: ["validate", tiny_file(t, edge("solver", "verifer"))],
    "duplicate node": lambda t, s: ["validate",
                                    tiny_file(t, lambda r: r["graph"]["nodes"].append(r["graph"]["nodes"][0]))],
    "bad agent name": lambda t, s: ["validate",
                                    tiny_file(t, lambda r: r["agents"].update(Solver=r["agents"].pop("solver")))],
    "unregistered parser or reward": lambda t, s: validate_tiny("agents.solver.reward=os.system"),
    "reward needs a problem field": lambda t, s: validate_tiny("agents.solver.reward=passes_tests"),
    "bad scheduler address": lambda t, s: train_tiny(t, "--dask-address", "localhost"),
    "run-wide setting per agent": lambda t, s: validate_tiny("agents.solver.training.mixed_precision=bf16"),
    "fp16": lambda t, s: validate_tiny("training.mixed_precision=fp16"),
    "sharded agents' shares over a worker's memory": lambda t, s: validate_tiny(
        "cluster.memory_limit=3MB", "training.sharding=full", "training.max_slots=2"),
    "sharded agents over different numbers of slots": lambda t, s: validate_tiny(
        "training.sharding=full", "training.max_slots=2", "agents.verifier.training.max_slots=3"),
    "sharded adapter agent": lambda t, s: validate_tiny("agents.solver.training.sharding=full",
                                                        "agents.solver.adapter={r: 4}"),
    "sharded state over a worker's memory": lambda t, s: train_tiny(
        t, *[a for o in ("cluster.memory_limit=2MB", "training.sharding=full", "training.max_slots=2",
                         "agents.verifier.training.sharding=none") for a in ("--set", o)]),
    "ZeRO-1 state over a worker's memory": lambda t, s: validate_tiny(
        "cluster.memory_limit=2MB", "training.sharding=optimizer", "training.max_slots=2",
        "agents.verifier.training.sharding=none"),
    "adapter on layers the model lacks": lambda t, s: validate_tiny("agents.solver.adapter={target_modules: [c_attn]}"),
    "adapter set under training": lambda t, s: validate_tiny("training.adapter={r: 4}"),
    "vLLM not installed": lambda t, s: validate_tiny("rollout.backend=vllm"),
    "workers' Python unusable": lambda t, s: validate_tiny(f"cluster.worker_python={t / 'no-python'}"),
    "missing model path": lambda t, s: validate_tiny(f"agents.solver.model={t / 'no-model'}"),
    "not a model directory": lambda t, s: (t / "empty").mkdir() or validate_tiny(f"agents.solver.model={t / 'empty'}"),
    "pickled weights": lambda t, s: validate_tiny(f"agents.solver.model={pickled_model(t)}"),
    "not a GGUF file": lambda t, s: validate_tiny(f"agents.solver.model={fake_gguf_file(t)}"),
    "damaged safetensors": lambda t, s: train_tiny(t, "--set", f"agents.solver.model={truncated_weights(t)}"),
    "tokenizer does not match its model":
        lambda t, s: validate_tiny(f"agents.verifier.model={tokenizer_mismatch_model(t)}"),
    "missing data file": lambda t, s: validate_tiny(f"data.path={t / 'nope.jsonl'}"),
    "corrupt JSONL line": lambda t, s: validate_tiny("data.path=" + text_file(
        t, '{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": 4}\n', "data.jsonl")),
    "JSONL answer without a number": lambda t, s: train_tiny(t, "--set", "data.path=" + text_file(
        t, '{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": "four"}\n', "data.jsonl")),
    "empty JSONL": lambda t, s: validate_tiny("data.path=" + text_file(t, "\n", "data.jsonl")),
    "unknown dataset": lambda t, s: validate_tiny("data.dataset=gsm_symbolc", "data.dataset_args={}"),
    "micro-batch of partial groups": lambda t, s: validate_tiny("training.micro_batch_size=6"),
    "unknown dataset argument": lambda t, s: train_tiny(t, "--set", "data.dataset_args.max_termz=3"),
    "dataset refuses its arguments": lambda t, s: validate_tiny("data.dataset_args.max_terms=1"),
    "run directory cannot be written": lambda t, s: (t / "a-file").write_text("") or [
        "train", "--preset", "tiny", "--run-dir", str(t / "a-file" / "x")],
    "store cannot be written": lambda t, s: (t / "a-file").write_text("") or train_tiny(
        t, "--set", f"store.uri={t / 'a-file' / 'store'}"),
    "corrupted Delta log": lambda t, s: damaged_run(t, corrupt_commit),
    "missing Delta commit": lambda t, s: damaged_run(t, delete_commit("samples/verifier", 1)),
    "resume of a store that fails verify": lambda t, s: damaged_run(t, delete_commit("samples/solver", 1)),
    "run directory in use": in_use,
    "bad `--where` filter": lambda t, s: ["store", "query", str(committed_store(t)[1]), "--agent", "solver",
                                          "--where", "score > 0"],
    "not a store": lambda t, s: damaged_run(t, lambda run_dir, store: shutil.rmtree(store.table_uri("updates"))),
    "a new run in a run directory": lambda t, s: committed_store(t) and ["train", "--preset", "tiny", "--run-dir",
                                                                          str(t / "run")],
    "nothing to resume": lambda t, s: (t / "nothing").mkdir() or ["train", "--resume", str(t / "nothing")],
    "a resumed run changes its settings": lambda t, s: damaged_run(t, lambda *_: None) + ["--set", "training.lr=0.1"],
    "Dask scheduler unreachable": lambda t, s: train_tiny(t, "--dask-address", f"tcp://127.0.0.1:{free_port()}",
                                                          "--set", "cluster.connect_timeout_s=2"),
    "not a Dask scheduler": lambda t, s: train_tiny(t, "--dask-address", f"tcp://127.0.0.1:{http_server(s)}",
                                                    "--set", "cluster.connect_timeout_s=2"),
    "Dask scheduler without workers": lambda t, s: train_tiny(t, "--dask-address", scheduler_without_workers(s),
                                                              "--set", "cluster.connect_timeout_s=1"),
    "Prefect API unreachable": lambda t, s: prefect_at(s, f"http://127.0.0.1:{free_port()}/api") or train_tiny(t),
    "Prefect API silent": lambda t, s: prefect_at(s, f"http://127.0.0.1:{silent_listener(s)}/api") or train_tiny(t),
}
REACH_PREFECT = {"Prefect API unreachable", "Prefect API silent"}  # refused at the Prefect step, by design

# Rows that are not a refusal on the command line: met while a run goes on (recorded, counted, or failing the
# run's flow with the message), or needing another environment.
DURING_A_RUN = {
    "head size vLLM's CPU attention lacks": "needs vLLM (.venv-vllm); tested in tests/flexmarl/rollout",
    "adapters a vLLM engine cannot hold":
        "needs vLLM (.venv-vllm); tested with vLLM patched in, tests/flexmarl/training",
    "a reward function raises": "recorded and counted while the run goes on",
    "an output does not parse": "recorded and counted while the run goes on",
    "NaN loss": "the update is skipped while the run goes on",
    "weight update that does not fit": "found by a replica during the run",
    "weight sync hangs": "a bound hit during the run",
    "engines do not start in time": "a bound hit while the engines start, inside the flow",
    "generation batch hangs": "a bound hit during the run",
    "another accelerate configuration": "found on a long-lived worker when the engines start",
    "training state missing": "found when a state moves between slots",
    "stale training state": "found when a state moves between slots",
    "training state of a version missing": "found when the engines start from their snapshots",
    "run stopped by a full disk": "met during the run, and not a user error (exit 1); tests/reliability fills a tmpfs",
    "run stopped by a lost Prefect API":
        "met during the run, and not a user error (exit 1); tested by killing the server",
    "worker resource nobody offers": "found when the engines are placed on the cluster, inside the flow",
    "more slots than workers": "found when the engines are placed on the cluster, inside the flow",
    "sharded over more slots than exist": "found when the engines are placed on the cluster, inside the flow",
}


def test_every_documented_row_is_run_through_the_cli_or_says_why_not() -> None:
    rows = set(documented_rows())
    assert not rows - set(CLI_CASES) - set(DURING_A_RUN), "rows neither run through the CLI nor listed as in-run"
    assert not (set(CLI_CASES) | set(DURING_A_RUN)) - rows, "cases for rows docs/errors.md no longer has"


@pytest.mark.parametrize("kind", sorted(CLI_CASES))
def test_every_cli_error_exits_2_without_a_traceback(kind: str, tmp_path: Path) -> None:
    import contextlib
    import signal

    from typer.testing import CliRunner

    from flows import cli

    def no_server(*args, **kwargs):  # fault injection: reaching the Prefect step would be the bug
        raise AssertionError("the run got as far as starting a Prefect server")

    sigterm = signal.getsignal(signal.SIGTERM)  # `train` installs its own handler; give the test runner its own
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        stack.callback(signal.signal, signal.SIGTERM, sigterm)
        args = CLI_CASES[kind](tmp_path, stack)
        if kind not in REACH_PREFECT:
            mp.setattr("flows.prefect_server.prefect_api", no_server)
        result = CliRunner().invoke(cli.app, args)
    shown = result.output + result.stderr
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, shown)
    assert "Traceback" not in shown
    (first, *_) = [line for line in result.stderr.splitlines() if line.strip()]
    assert first.startswith("error: "), result.stderr
    for span in documented_rows()[kind]:
        assert message_pattern(span).search(result.stderr), f"{kind}: docs/errors.md says {span!r}; printed:\n{shown}"
    new_run = tmp_path / "new-run"
    if kind != "run directory in use":  # a refused start leaves nothing behind
        assert not new_run.exists(), sorted(p.name for p in new_run.iterdir())


def test_a_state_over_a_worker_s_limit_passes_the_preflight_once_sharded_over_enough_ranks() -> None:
    """The tiny solver's 3.21 MiB of state is refused on one 2.86 MiB worker, and passes sharded over two (each
    rank 2.14 MiB: half the state and the whole weights; under ZeRO-1 2.67 MiB: half the AdamW moments); the
    verifier, an adapter, is small either way."""
    from flexmarl.config import ConfigError, load_config
    from flexmarl.preflight import check_training_memory

    small = ["cluster.memory_limit=3MB", "agents.verifier.adapter={r: 4}"]
    with pytest.raises(ConfigError, match="agents.solver: its training state needs at least 3.21 MiB"):
        check_training_memory(load_config(preset="tiny", overrides=small))
    for sharding in ("full", "optimizer"):
        check_training_memory(load_config(preset="tiny", overrides=[
            *small, f"agents.solver.training.sharding={sharding}", "agents.solver.training.max_slots=2"]))
    with pytest.raises(ConfigError, match=r"sharded \('full'\) over 2 ranks, needs at least 2.14 MiB on each"):
        check_training_memory(load_config(preset="tiny", overrides=[
            "cluster.memory_limit=2MB", "agents.verifier.adapter={r: 4}", "agents.solver.training.sharding=full",
            "agents.solver.training.max_slots=2"]))
