"""The tiny preset end to end through the real Prefect flow, a real Dask LocalCluster and Delta tables."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import torch
import yaml
from deltalake import DeltaTable
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexmarl.config import load_config
from flexmarl.models.loading import load_model, resolve_model
from flexmarl.training.snapshots import SNAPSHOTS, load_weights, snapshot_uri
from flows.train import train_run

STEPS, QUERIES, GROUP = 2, 2, 4


def test_tiny_run_trains_both_agents_and_the_store_matches_the_report(prefect_api, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    report = train_run(
        preset="tiny", steps=STEPS, run_dir=str(run_dir),
        # seed 3: both tiny agents get a gradient in two steps (at seed 0 every group's rewards tie)
        overrides=[f"run.queries_per_step={QUERIES}", f"run.group_size={GROUP}", "run.seed=3"],
    )
    assert set(report["agents"]) == {"solver", "verifier"}
    assert report["mode"] == "flexmarl" and 0 < report["utilization"] <= 1
    assert report["store_write_s"] > 0 and report["store_read_s"] > 0
    # the driver's busy share in each step's window: one per step, a share of that window
    assert list(report["driver_busy_by_step"]) == [str(s) for s in range(STEPS)]
    assert all(0 < share < 1 for share in report["driver_busy_by_step"].values())
    updates = DeltaTable(str(run_dir / "store" / "updates")).to_pyarrow_table()
    trained: dict[str, dict[str, torch.Tensor]] = {}
    for agent, a in report["agents"].items():
        assert a["policy_version"] == STEPS and a["updates"] == STEPS
        assert len(a["mean_reward"]) == STEPS

        # an independent reader finds exactly the reported samples
        samples = DeltaTable(str(run_dir / "store" / "samples" / agent)).to_pyarrow_table()
        assert samples.num_rows == a["samples_generated"] == STEPS * QUERIES * GROUP
        ids = samples["sample_id"].to_pylist()
        assert len(set(ids)) == len(ids)
        assert a["tokens_generated"] == sum(len(r) for r in samples["response_ids"].to_pylist())

        # every update consumed exactly the samples of the version it updated from
        mine = updates.filter(pc.field("agent") == agent).sort_by("policy_version")
        assert mine["policy_version"].to_pylist() == list(range(1, STEPS + 1))
        for version, consumed in zip(mine["policy_version"].to_pylist(), mine["consumed_ids"].to_pylist()):
            generated = samples.filter(pc.field("policy_version") == version - 1)["sample_id"].to_pylist()
            assert sorted(consumed) == sorted(generated)
        assert a["samples_trained"] == samples.num_rows

        # parents recorded: each verifier sample points at the solver sample of its episode
        if agent == "verifier":
            for sid, parents in zip(ids, samples["parent_ids"].to_pylist()):
                input_id, _, traj = sid.rsplit("_", 2)
                assert parents == [f"{input_id}_0_{traj}"]

        # the final checkpoint is a loadable Hugging Face model (and tokenizer) holding exactly the weights the run
        # trained: those of the agent's training-state snapshot at v{STEPS}, which a resume would continue from
        ckpt = run_dir / "checkpoints" / agent / f"v{STEPS}"
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        assert len(AutoTokenizer.from_pretrained(ckpt)) <= model.get_input_embeddings().weight.shape[0]
        saved = model.state_dict()
        trained[agent] = load_weights(snapshot_uri(str(run_dir / "state" / SNAPSHOTS), agent, STEPS))
        assert trained[agent].keys() == saved.keys()
        assert all(torch.equal(saved[k], v) for k, v in trained[agent].items())

    # and they are not the weights they started from
    cfg = load_config(run_dir / "config.yaml")
    for agent, weights in trained.items():
        initial = load_model(resolve_model(cfg.agents[agent].model, seed=cfg.run.seed)).state_dict()
        assert any(not torch.equal(v, initial[k]) for k, v in weights.items()), agent

    episodes = DeltaTable(str(run_dir / "store" / "episodes")).to_pyarrow_table()
    assert episodes.num_rows == STEPS * QUERIES * GROUP
    assert (run_dir / "report.json").exists() and (run_dir / "config.yaml").exists()

    # the evaluate flow runs the team of the latest checkpoints, greedily and so reproducibly, on unseen problems,
    # beside the base team, and writes what it ran
    from flows.evaluate import evaluate_run

    first = evaluate_run(str(run_dir), n=4, batch_size=2)
    assert first["model_dirs"]["trained"]["solver"].endswith(f"checkpoints/solver/v{STEPS}") and first["n"] == 4
    assert 0.0 <= first["trained"]["team"]["accuracy"] <= 1.0
    assert set(first["base_judges"]) == {"verifier"}
    assert first["trained"]["agents"]["verifier"]["judge"]["n"] == 4  # one verdict per solver answer
    assert first["base_judges"]["verifier"]["on_first_answers"]["n"] == 4
    runs = [json.loads(line) for line in (run_dir / "evaluation_runs.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "evaluation.json").read_text()) == first
    # a run trained on a scheduler that is gone by now is evaluated on a cluster of its own
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    raw["cluster"]["address"] = "tcp://127.0.0.1:9"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    assert evaluate_run(str(run_dir), n=4, batch_size=2) == first
    train_questions = {t["fields"]["question"] for t in map(json.loads, episodes["task"].to_pylist())}
    assert len(runs) == 4 and not {r["problem"]["fields"]["question"] for r in runs} & train_questions
