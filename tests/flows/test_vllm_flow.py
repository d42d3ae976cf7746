"""vLLM inside the flow: the driver (with Prefect) here, the workers from .venv-vllm (with vLLM), one scheduler.

Runs where `make setup-vllm` has built .venv-vllm (CI does, before the suite); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.cluster.worker_python import WorkerPythonError, check_worker_python, probe
from flexmarl.config import load_config

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# `make setup-vllm` writes its stamp once the environment is complete
needs_vllm_env = pytest.mark.skipif(not (VLLM_PYTHON.parents[1] / ".flexmarl-installed").is_file(),
                                    reason="no .venv-vllm (make setup-vllm)")


@needs_vllm_env
def test_a_vllm_run_trains_through_the_flow_with_workers_of_the_vllm_environment(prefect_api, tmp_path) -> None:
    from flows.train import train_run

    assert probe(str(VLLM_PYTHON)).has_vllm
    state = train_run(
        preset="tiny", steps=2, backend="vllm", run_dir=str(tmp_path / "run"), return_state=True,
        overrides=[f"cluster.worker_python={VLLM_PYTHON}", "agents.solver.model=tiny-large",
                   "agents.verifier.model=tiny-large", "rollout.vllm={kv_cache_gb: 0.25, max_model_len: 512}",
                   "run.queries_per_step=2"],
    )
    report = state.result()
    assert state.is_completed()
    assert {a: r["policy_version"] for a, r in report["agents"].items()} == {"solver": 2, "verifier": 2}
    assert all(r["samples_generated"] > 0 for r in report["agents"].values())
    assert (tmp_path / "run" / "checkpoints" / "solver" / "v2").is_dir()


def test_a_worker_python_that_cannot_serve_is_refused_before_the_run(tmp_path) -> None:
    missing = load_config(preset="tiny", overrides=[f"cluster.worker_python={tmp_path / 'nope'}"]).cluster
    with pytest.raises(WorkerPythonError, match="is not a file; give the Python of the workers' environment"):
        check_worker_python(missing, needs_vllm=False)
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho not a python\n")
    script.chmod(0o755)
    with pytest.raises(WorkerPythonError, match="does not run as a Python interpreter"):
        check_worker_python(load_config(preset="tiny", overrides=[f"cluster.worker_python={script}"]).cluster,
                            needs_vllm=False)


@needs_vllm_env
def test_the_vllm_environment_matches_the_driver_in_what_crosses() -> None:
    worker = probe(str(VLLM_PYTHON))  # raises, naming the packages, where they differ
    assert worker.has_vllm
