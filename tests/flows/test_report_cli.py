"""`flexmarl report`, the flow's summary artifacts and its tracking, on one real tiny run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from typer.testing import CliRunner

from flexmarl.report.series import load_series
from flexmarl.run.timeline_file import read_timeline
from flexmarl.run.directory import RunDirectory
from flows.cli import app

runner = CliRunner()


def test_report_draws_every_picture_and_summarises_the_run(tiny_run, tmp_path: Path) -> None:
    out = tmp_path / "report"
    res = runner.invoke(app, ["report", str(tiny_run.run_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = tiny_run.report
    for name in ("rewards.png", "agent_solver.png", "agent_verifier.png", "timeline.png"):
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width >= 800 and height >= 150, name
    assert matplotlib.image.imread(out / "agent_solver.png").shape[0] > 1000  # a row per metric

    md = (out / "report.md").read_text()
    assert f"# FlexMARL run `{report['run_id']}`" in md
    for agent, a in report["agents"].items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {agent} | tiny |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2:6] == [str(a["policy_version"]), str(a["updates"]), str(a["samples_generated"]),
                              str(a["samples_trained"])]
    assert md.count("| worker ") == report["workers"] + 1  # the header and one row per worker
    assert "queries_per_step: 2" in md  # the resolved config

    page = (out / "report.html").read_text()
    queues = {"queues.png"} if read_timeline(tiny_run.run_dir / "timeline.json").queue_trace else set()
    assert set(re.findall(r'<img src="([^"]+)"', page)) == {
        "rewards.png", "meg.png", "agent_solver.png", "agent_verifier.png", "timeline.png", *queues}
    assert "<table>" in page and report["run_id"] in page


def test_series_agree_with_the_store_and_the_timeline(tiny_run) -> None:
    run = RunDirectory(tiny_run.run_dir)
    timeline = read_timeline(tiny_run.run_dir / "timeline.json")
    assert timeline.wall_s == pytest.approx(tiny_run.report["pipeline_s"])
    series = load_series(run)
    updates = DeltaTable(str(tiny_run.run_dir / "store" / "updates")).to_pyarrow_table()
    for agent, s in series.items():
        samples = DeltaTable(str(tiny_run.run_dir / "store" / "samples" / agent)).to_pyarrow_table()
        assert s.reward == pytest.approx(tiny_run.report["agents"][agent]["mean_reward"])
        for step, entropy in zip(s.steps, s.entropy, strict=True):
            lps = [lp for row in samples.filter(pc.field("step") == step)["logprobs"].to_pylist() for lp in row]
            assert entropy == pytest.approx(-sum(lps) / len(lps))
        assert s.versions == [1, 2]
        assert s.staleness == [u.staleness for u in sorted(
            (u for u in timeline.updates if u.agent == agent), key=lambda u: u.policy_version)]
        first = updates.filter((pc.field("agent") == agent) & (pc.field("policy_version") == 1))
        assert s.tokens_per_s[0] == pytest.approx(first["num_tokens"][0].as_py() / s.update_s[0])
        assert s.samples_by_version == {0: samples.num_rows // 2, 1: samples.num_rows // 2}


def test_the_flow_publishes_the_summary_and_the_agent_metrics_table(tiny_run) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[tiny_run.flow_run_id])))
    by_key = {a.key: a for a in artifacts}
    table = by_key["agent-metrics"].data
    rows = json.loads(table) if isinstance(table, str) else table
    assert {r["agent"] for r in rows} == {"solver", "verifier"}
    for r in rows:
        a = tiny_run.report["agents"][r["agent"]]
        assert (r["policy_version"], r["samples_trained"], r["mean_reward_last"]) == (
            a["policy_version"], a["samples_trained"], pytest.approx(a["mean_reward"][-1]))
    summary = by_key["run-summary"].data
    assert f"# FlexMARL run `{tiny_run.report['run_id']}`" in summary
    assert "## Agents" in summary and "## Utilisation" in summary and "## Pictures" not in summary


def test_the_flow_tracked_every_update_in_tensorboard_and_mlflow(tiny_run) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    updates = DeltaTable(str(tiny_run.run_dir / "store" / "updates")).to_pyarrow_table()
    scalars = EventAccumulator(str(tiny_run.run_dir / "tensorboard"))
    scalars.Reload()
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run.run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("flexmarl").experiment_id])
    assert run.info.run_name == tiny_run.report["run_id"] and run.info.status == "FINISHED"
    for agent in ("solver", "verifier"):
        mine = updates.filter(pc.field("agent") == agent).sort_by("policy_version")
        losses = [dict(m)["loss/policy"] for m in mine["metrics"].to_pylist()]
        assert [(e.step, e.value) for e in scalars.Scalars(f"{agent}/loss/policy")] == [
            (1, pytest.approx(losses[0])), (2, pytest.approx(losses[1]))]
        history = client.get_metric_history(run.info.run_id, f"{agent}/batch/tokens")
        assert [(m.step, m.value) for m in history] == [(v, float(n)) for v, n in zip(
            mine["policy_version"].to_pylist(), mine["num_tokens"].to_pylist(), strict=True)]
    assert run.data.metrics["run/utilization"] == pytest.approx(tiny_run.report["utilization"])


def test_an_unfinished_run_still_gets_a_report_and_a_bad_path_an_error(tiny_run, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(tiny_run.run_dir, partial, ignore=shutil.ignore_patterns("report.json", "timeline.json",
                                                                             "tensorboard", "mlflow.db"))
    res = runner.invoke(app, ["report", str(partial)])
    assert res.exit_code == 0, res.output
    md = (partial / "report" / "report.md").read_text()
    assert "no report.json: the run has not finished" in md and "no timeline.json" in md
    assert not (partial / "report" / "timeline.png").exists() and not (partial / "report" / "queues.png").exists()

    res = runner.invoke(app, ["report", str(tiny_run.run_dir / "store")])
    assert res.exit_code == 2 and "has no config.yaml" in res.output
