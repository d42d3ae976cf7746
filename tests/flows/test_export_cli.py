"""`flexmarl export` on a real tiny run: a model directory that transformers loads and generates with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def test_an_exported_agent_loads_with_transformers_and_generates(tiny_run, tmp_path: Path) -> None:
    out = tmp_path / "solver"
    res = runner.invoke(app, ["export", str(tiny_run.run_dir), "--agent", "solver", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "flexmarl_agent.json"} <= {p.name for p in out.iterdir()}
    # the weights are as readable as the config (safetensors alone writes its file 0600)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        p.name: (out / "config.json").stat().st_mode & 0o777 for p in out.iterdir()}

    model = AutoModelForCausalLM.from_pretrained(out)
    trained = AutoModelForCausalLM.from_pretrained(tiny_run.run_dir / "checkpoints" / "solver" / "v2")
    for (name, a), (_, b) in zip(model.state_dict().items(), trained.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the weights of the version asked for, unchanged

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template  # the template the rollout built prompts with
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute: 2 + 3"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    generated = model.generate(**prompt, max_new_tokens=6)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert model.generation_config.temperature == 1.0 and model.generation_config.max_new_tokens == 24
    info = json.loads((out / "flexmarl_agent.json").read_text())
    assert (info["agent"], info["policy_version"], info["run_id"]) == ("solver", 2, tiny_run.report["run_id"])
    assert info["prompt"] == "Compute: {question}"


def test_a_missing_version_or_agent_or_a_used_folder_is_refused(tiny_run, tmp_path: Path) -> None:
    res = runner.invoke(app, ["export", str(tiny_run.run_dir), "--agent", "solver", "--version", "1",
                              "--out", str(tmp_path / "v1")])
    assert res.exit_code == 2
    assert "no checkpoint of version 1; versions available: 2" in " ".join(res.output.split())
    assert not (tmp_path / "v1").exists()

    res = runner.invoke(app, ["export", str(tiny_run.run_dir), "--agent", "planner", "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and "agents: solver, verifier" in " ".join(res.output.split())

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    res = runner.invoke(app, ["export", str(tiny_run.run_dir), "--agent", "verifier", "--out", str(used)])
    assert res.exit_code == 2 and "not an empty directory" in " ".join(res.output.split())
    assert [p.name for p in used.iterdir()] == ["notes.txt"]


def test_an_adapter_agent_trains_through_the_flow_and_exports_as_a_peft_adapter_or_merged(prefect_api,
                                                                                          tmp_path: Path) -> None:
    from peft import PeftConfig, PeftModel

    from flows.train import train_run

    run_dir = tmp_path / "run"
    # the solver trains a LoRA adapter, the verifier (the same tiny model) all its weights, side by side
    train_run(preset="tiny", steps=2, run_dir=str(run_dir),
              overrides=["run.queries_per_step=4", "agents.solver.adapter={r: 4, alpha: 8}"])
    checkpoint = run_dir / "checkpoints" / "solver" / "v2"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
    assert (run_dir / "checkpoints" / "verifier" / "v2" / "model.safetensors").exists()

    out = tmp_path / "solver"
    res = runner.invoke(app, ["export", str(run_dir), "--agent", "solver", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "PeftModel.from_pretrained" in res.output
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "flexmarl_agent.json"} <= {
        p.name for p in out.iterdir()}
    assert "model.safetensors" not in {p.name for p in out.iterdir()}  # the adapter alone: a fraction of the model
    base = AutoModelForCausalLM.from_pretrained(PeftConfig.from_pretrained(out).base_model_name_or_path)
    model = PeftModel.from_pretrained(base, out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute: 2 + 3"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    assert model.generate(**prompt, max_new_tokens=6, do_sample=False).shape[1] > prompt["input_ids"].shape[1]
    assert json.loads((out / "flexmarl_agent.json").read_text())["adapter"]["r"] == 4

    merged_out = tmp_path / "solver-merged"
    res = runner.invoke(app, ["export", str(run_dir), "--agent", "solver", "--merge", "--out", str(merged_out)])
    assert res.exit_code == 0, res.output
    merged = AutoModelForCausalLM.from_pretrained(merged_out).eval()  # a plain model directory
    with torch.no_grad():
        assert torch.allclose(merged(**prompt).logits, model(**prompt).logits, atol=1e-5)

    res = runner.invoke(app, ["export", str(run_dir), "--agent", "verifier", "--merge", "--out", str(tmp_path / "v")])
    assert res.exit_code == 2 and "no adapter" in " ".join(res.output.split())
