"""Adapter agents on vLLM, for real: one engine serves several agents' LoRA adapters (`make test-vllm`).

The HF adapter replica (peft, checked against the trainer in test_adapter_agents.py) is the reference: a vLLM
replica with the same adapter tensors must sample the same tokens with the same log-probs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexmarl.cluster.worker_state import EngineKey, engines
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.adapters import AdapterHost
from flexmarl.models.loading import resolve_model
from flexmarl.rollout import replica
from flexmarl.rollout.adapter_backend import AdapterBackend
from flexmarl.rollout.backend import GenerationRequest, WeightSyncError, WeightUpdate
from flexmarl.rollout.config import RolloutConfig, VLLMSettings
from flexmarl.rollout.vllm_adapter_backend import VLLMAdapterBackend

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm runs it in .venv-vllm")

LORA = AdapterConfig(r=8, alpha=16)
ROLLOUT = RolloutConfig(backend="vllm", vllm=VLLMSettings(kv_cache_gb=0.25, max_model_len=512, max_loras=2,
                                                          max_lora_rank=8))
PROMPTS = [[257, 72, 105], [257, 65, 66, 67, 68, 69, 70], [257, 48, 49]]


def requests(temperature: float = 0.0) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, 12, temperature, seed=i) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def model_dir(model_cache) -> Path:
    return resolve_model("tiny-large", seed=0)  # vLLM's CPU attention lacks the head size of 'tiny'


@pytest.fixture(scope="module")
def hf(model_dir):
    """HF adapter replicas of two agents, with trained-looking adapters (B no longer zero)."""
    host = AdapterHost(model_dir, torch.device("cpu"))
    backends = {agent: AdapterBackend(host, agent, LORA) for agent in ("solver", "verifier")}
    gen = torch.Generator().manual_seed(0)
    for b in backends.values():
        b.update_weights(WeightUpdate("x", 1, {k: torch.randn(v.shape, generator=gen) * 0.3
                                               for k, v in host.state(b.adapter).items()}))
    return backends


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Both agents' vLLM replicas, opened as a worker opens them: one engine for the two."""
    keys = [EngineKey("run-a", "solver"), EngineKey("run-a", "verifier")]
    backends = {k.agent: replica.open_backend(str(model_dir), 0, ROLLOUT, k, LORA) for k in keys}
    yield backends
    for b in backends.values():
        b.close()
    engines().release([k for k in engines() if k.startswith("replica:run-a/")])


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.logprobs == pytest.approx(y.logprobs, abs=2e-4)


def _score(backend: AdapterBackend, request, result, temperature: float) -> list[float]:
    ids = torch.tensor([request.prompt_ids + result.response_ids.tolist()])
    with torch.no_grad(), backend.host.active(backend.adapter) as model:
        logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(result.response_ids)[:, None])[:, 0].tolist()


@pytest.mark.vllm
def test_adapter_agents_share_one_engine_and_sample_as_their_hf_replicas(replicas, hf, model_dir) -> None:
    solver, verifier = replicas["solver"], replicas["verifier"]
    assert isinstance(solver, VLLMAdapterBackend) and solver.engine is verifier.engine  # one engine, two agents
    assert [k for k in engines() if k.startswith("replica:run-a/")] == [f"replica:run-a/~base:{model_dir}"]

    base = solver.generate(requests())  # version 0: LoRA's start (B = 0) is the base model
    assert {r.policy_version for r in base} == {0}
    _same(verifier.generate(requests()), base)

    update = WeightUpdate("solver", 1, hf["solver"].host.state(hf["solver"].adapter))
    solver.update_weights(update)
    trained = solver.generate(requests())
    assert {r.policy_version for r in trained} == {1}
    # the adapter is in use
    assert [r.response_ids.tolist() for r in trained] != [r.response_ids.tolist() for r in base]
    _same(trained, hf["solver"].generate(requests()))  # greedy: the same tokens and log-probs as peft's
    for request, result in zip(requests(0.8), solver.generate(requests(0.8)), strict=True):
        # sampled: the stored log-probs are those the trainer computes, with the adapter, at the temperature
        assert result.logprobs == pytest.approx(_score(hf["solver"], request, result, 0.8), abs=2e-4)
    _same(verifier.generate(requests()), base)  # the other agent's replica still serves its own (v0) adapter

    first = Path(solver._lora.lora_path)
    assert first.name == "v1" and (first / "adapter_config.json").is_file()
    solver.update_weights(WeightUpdate("solver", 2, hf["verifier"].host.state(hf["verifier"].adapter)))
    _same(solver.generate(requests()), hf["verifier"].generate(requests()))
    assert not first.exists()  # the previous version's adapter is dropped: files and engine slot
    assert solver.engine._engine().llm_engine.list_loras() == {solver._lora.lora_int_id}


@pytest.mark.vllm
def test_a_bad_adapter_update_is_refused_before_the_engine(replicas) -> None:
    solver = replicas["solver"]
    state = {k: torch.zeros(v.shape) for k, v in solver._reference.items()}
    with pytest.raises(WeightSyncError, match="missing"):
        solver.update_weights(WeightUpdate("solver", solver.version + 1, dict(list(state.items())[1:])))
    wrong = dict(state)
    key = next(iter(wrong))
    wrong[key] = torch.zeros(3, 3)
    with pytest.raises(WeightSyncError, match=r"got \(3, 3\)"):
        solver.update_weights(WeightUpdate("solver", solver.version + 1, wrong))
    version = solver.version
    solver.update_weights(WeightUpdate("solver", version + 1, state))  # the engine still takes a good one
    assert solver.version == version + 1


@pytest.mark.vllm
@pytest.mark.cluster
def test_adapter_agents_train_through_the_pipeline_on_vllm(tmp_path, model_cache) -> None:
    """The whole pipeline (real Dask cluster, store, trainers) with both agents' rollouts on vLLM adapters."""
    from deltalake import DeltaTable

    from flexmarl.bench.pipeline_bench import MODES, run_mode
    from flexmarl.cluster.config import ClusterConfig
    from flexmarl.cluster.local import open_cluster
    from flexmarl.config import load_config
    from storage.store import ExperienceStore
    from storage.verify import verify_store

    cfg = load_config(preset="tiny", overrides=[
        "agents.solver.model=tiny-large", "agents.verifier.model=tiny-large",
        "agents.solver.adapter={r: 8, alpha: 16}", "agents.verifier.adapter={r: 8, alpha: 16}",
        "rollout.backend=vllm", "rollout.vllm={kv_cache_gb: 0.25, max_model_len: 512, max_lora_rank: 8}",
        "run.steps=2", "run.queries_per_step=4", "run.group_size=4", "training.micro_batch_size=8",
        "training.lr=1e-2", *MODES["flexmarl"]])
    with open_cluster(ClusterConfig(n_workers=2)) as address:
        result, weights = run_mode(cfg, tmp_path / "run", address)
    assert {u.agent for u in result.updates} == {"solver", "verifier"} and len(result.updates) == 4
    assert all(all("lora_" in name for name in w) for w in weights.values())  # only adapters trained and synced
    store = ExperienceStore(str(tmp_path / "run" / "store"))
    assert verify_store(store) == []  # every update trained on samples of the version it updated from
    # the trainer re-scores what vLLM sampled through the adapter: importance weights stay near 1 at version 1
    metrics = [dict(m) for m in DeltaTable(store.table_uri("updates")).to_pyarrow_table()["metrics"].to_pylist()]
    ratios = [m["policy/is_weight_mean"] for m in metrics if "policy/is_weight_mean" in m]
    assert ratios and max(abs(r - 1) for r in ratios) < 1e-3, ratios
