"""The vLLM backend, for real: these tests run in .venv-vllm (`make test-vllm`) and are skipped elsewhere.

vLLM's CPU attention does not support the head size of the built-in 'tiny' model (16), so the engine tests
use 'tiny-large' (same byte tokenizer and Qwen2 architecture, head size 32), loaded from its saved directory.
One engine is shared by the module: each start costs about a minute on CPU.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.models.loading import ModelError, load_model, resolve_model
from flexmarl.rollout.backend import GenerationRequest, WeightSyncError, WeightUpdate
from flexmarl.rollout.config import RolloutConfig, VLLMSettings, vllm_installed
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.rollout.vllm_backend import VLLMBackend

SETTINGS = VLLMSettings(kv_cache_gb=0.25, max_model_len=512)
KEY = EngineKey("run", "a")
PROMPTS = [[257, 72, 105], [257, 65, 66, 67, 68, 69, 70], [257] + [97 + i for i in range(12)], [257, 48, 49]]


@pytest.fixture(scope="module")
def model_dirs(model_cache):
    return resolve_model("tiny-large", seed=0), resolve_model("tiny-large", seed=1)


@pytest.fixture(scope="module")
def engine(model_dirs):
    with VLLMBackend(model_dirs[0], settings=SETTINGS) as backend:
        yield backend


def _state(model_dir) -> dict[str, torch.Tensor]:
    return load_model(model_dir).state_dict()


def _greedy(backend, n_new: int = 24):
    return backend.generate([GenerationRequest(f"g{i}", p, n_new, 0.0, seed=0) for i, p in enumerate(PROMPTS)])


@pytest.mark.vllm
def test_generation_returns_ids_and_the_logprobs_of_the_sampled_sequence(engine, model_dirs) -> None:
    temperature = 0.7
    requests = [GenerationRequest(f"r{i}", p, 16, temperature, seed=i) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]

    model = load_model(model_dirs[0]).eval()
    for request, result in zip(requests, results):
        assert 1 <= len(result.response_ids) <= 16 and len(result.logprobs) == len(result.response_ids)
        assert (result.response_ids.dtype, result.logprobs.dtype) == (np.int32, np.float32)
        ends_with_eos = result.response_ids[-1] == engine.eos_id
        assert result.finish_reason == ("stop" if ends_with_eos else "length")
        assert engine.eos_id not in result.response_ids[:-1]  # generation stops at the first EOS
        assert result.policy_version == engine.version
        # The trainer's score of the same tokens: log softmax(logits / T) at each response position.
        ids = torch.tensor([request.prompt_ids + result.response_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1]  # (T, V)
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(request.prompt_ids) :, None])
        assert result.logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=1e-3)


@pytest.mark.vllm
def test_a_response_depends_on_its_seed_not_on_its_batch(engine) -> None:
    target = GenerationRequest("t", [257, 70, 71, 72], 16, 1.0, seed=42)
    others = [GenerationRequest(f"o{i}", [257] + [80 + i] * (i + 1), 16, 1.0, seed=i) for i in range(5)]
    alone = engine.generate([target])[0]
    batched = {r.request_id: r for r in engine.generate(others[:2] + [target] + others[2:])}["t"]
    assert batched.response_ids.tolist() == alone.response_ids.tolist()
    reseeded = engine.generate([GenerationRequest("t", target.prompt_ids, 16, 1.0, seed=43)])[0]
    assert reseeded.response_ids.tolist() != alone.response_ids.tolist()


@pytest.mark.vllm
def test_greedy_vllm_equals_greedy_hf(engine, model_dirs) -> None:
    vllm_results, hf_results = _greedy(engine), _greedy(HFBackend(model_dirs[0], device="cpu"))
    for v, h in zip(vllm_results, hf_results):
        assert v.response_ids.tolist() == h.response_ids.tolist()
        assert v.finish_reason == h.finish_reason
        assert v.logprobs == pytest.approx(h.logprobs, abs=1e-3)


@pytest.mark.vllm
def test_a_bad_update_is_refused_before_the_engine_and_a_good_one_changes_outputs(engine, model_dirs) -> None:
    before, version = _greedy(engine), engine.version
    good = _state(model_dirs[1])
    name = "model.layers.0.self_attn.q_proj.weight"
    bad_updates = {
        r"\(3, 3\)": {**good, name: torch.zeros(3, 3)},
        "torch.float16": {**good, name: good[name].half()},
        "unexpected model.extra.weight": {**good, "model.extra.weight": torch.zeros(1)},
        f"missing {name}": {k: v for k, v in good.items() if k != name},
    }
    for message, state in bad_updates.items():
        with pytest.raises(WeightSyncError, match=f"agent 'a'.*{message}"):
            engine.update_weights(WeightUpdate("a", version + 1, state))
        assert engine.version == version
    # The engine survived the refusals and still holds the old weights.
    assert [r.response_ids.tolist() for r in _greedy(engine)] == [r.response_ids.tolist() for r in before]

    engine.update_weights(WeightUpdate("a", version + 1, good))
    try:
        assert engine.version == version + 1
        after = _greedy(engine)
        assert all(r.policy_version == version + 1 for r in after)
        assert [r.response_ids.tolist() for r in after] != [r.response_ids.tolist() for r in before]
        # The update took effect completely: the engine now decodes as the seed-1 model does.
        hf = _greedy(HFBackend(model_dirs[1]))
        assert [r.response_ids.tolist() for r in after] == [r.response_ids.tolist() for r in hf]
    finally:
        engine.update_weights(WeightUpdate("a", version + 2, _state(model_dirs[0])))  # later tests expect seed 0
    assert [r.response_ids.tolist() for r in _greedy(engine)] == [r.response_ids.tolist() for r in before]


@pytest.mark.vllm
@pytest.mark.cluster
def test_a_replica_on_a_default_dask_worker_serves_the_model(engine, model_dirs) -> None:
    from distributed import Client, LocalCluster

    from flexmarl.rollout import replica

    request = GenerationRequest("d", PROMPTS[1], 16, 1.0, seed=7)
    expected = engine.generate([request])[0].response_ids.tolist()
    rollout = RolloutConfig(backend="vllm", vllm=SETTINGS)
    # Default (daemonic) worker processes: the in-process engine needs no child processes.
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        register(client)
        client.submit(replica.start_replica, KEY, str(model_dirs[0]), 0, rollout, pure=False).result()
        [served] = client.submit(replica.generate, KEY, [request], pure=False).result()
        assert served.response_ids.tolist() == expected and served.policy_version == 0
        loaded = client.submit(replica.load_weights, KEY, 1, _state(model_dirs[1]), pure=False).result()
        assert loaded.version == 1 and loaded.nbytes > 0
        [after] = client.submit(replica.generate, KEY, [request], pure=False).result()
        assert after.policy_version == 1 and after.response_ids.tolist() != expected


@pytest.mark.vllm
def test_a_backend_pickles_its_settings_before_start_and_refuses_after(engine, model_dirs) -> None:
    backend = VLLMBackend(model_dirs[1], version=3, settings=SETTINGS)
    copy = pickle.loads(pickle.dumps(backend))
    assert (copy.model_dir, copy.version, copy.settings) == (model_dirs[1], 3, SETTINGS)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(engine)


@pytest.mark.vllm
def test_a_model_with_a_head_size_cpu_vllm_lacks_is_refused_before_start(model_cache) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size limit is vLLM's CPU attention's")
    with pytest.raises(ModelError, match="head size 16.*tiny-large"):
        VLLMBackend(resolve_model("tiny"), settings=SETTINGS)


@pytest.mark.skipif(vllm_installed(), reason="checks the error where vllm is missing")
def test_without_vllm_the_config_and_the_backend_say_how_to_install_it(tiny_dir) -> None:
    from flexmarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"cluster.worker_python=.venv-vllm/bin/python"):
        load_config(preset="tiny", overrides=["rollout.backend=vllm"])
    with pytest.raises(ImportError, match="make setup-vllm"):
        VLLMBackend(tiny_dir)
