"""Shared fixtures: hermetic model cache, one torch thread, one Prefect test API per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # its telemetry writes race on SQLite
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Build the tiny model into a per-session cache, never the user's ~/.cache."""
    cache = str(tmp_path_factory.mktemp("flexmarl-cache"))
    os.environ["FLEXMARL_CACHE"] = cache
    return cache


@pytest.fixture(scope="session")
def prefect_api():
    """A temporary Prefect API (SQLite) shared by every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_dir(model_cache: str):
    from flexmarl.models.loading import resolve_model

    return resolve_model("tiny")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` run in .venv-vllm (``make test-vllm``); elsewhere they are skipped."""
    from flexmarl.rollout.config import vllm_installed

    if vllm_installed():
        return
    skip = pytest.mark.skip(reason="vllm not installed (make setup-vllm)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
