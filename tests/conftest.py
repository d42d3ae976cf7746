"""Shared fixtures: a home and model cache of the session's own, one torch thread, one Prefect test API.

The suite's slow groups are markers (``make test`` runs everything; ``make test-fast`` deselects them). The rule,
applied by ``pytest_collection_modifyitems`` below and by hand:

- ``reliability``: every test under tests/reliability (a real tiny run hit by a real fault);
- ``e2e``: every test under tests/e2e (real processes and a browser);
- ``flow``: every test under tests/flows, and every test using the ``prefect_api`` or ``tiny_run`` fixture: it
  runs a Prefect flow or server;
- ``cluster``: the heavy compute: a test that starts Dask workers (``open_cluster``, ``LocalCluster``: processes
  or threads; a scheduler alone, ``n_workers=0``, is not one), trains through the pipeline, benchmarks a model
  (``bench_rollout``, ``bench_pipeline``, ``bench_adapters``, ``compare_backends``, ``gpu_check``), or builds
  SmolLM2 from its GGUF file (~20 s, once per session). Set here for the ``tiny_run`` fixture; anywhere else the
  test says so itself: ``@pytest.mark.cluster``, or ``pytestmark = pytest.mark.cluster`` where every test of
  its module is one;
- ``vllm``: needs the vllm package (by hand; skipped outside .venv-vllm).

A test in none of them must be fast: under a second or two here, a few seconds where it waits out a bound on
purpose, so that ``make test-fast`` stays under 2 minutes (``make test-fast PYTEST_ARGS=--durations=15`` lists the
slowest).
"""

from __future__ import annotations

import ast
import gc
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # its telemetry writes race on SQLite
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


HOME = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the session a home of its own, before anything reads one: no test reads or writes the user's home
    (Prefect's profile and database, Hugging Face's and matplotlib's caches, vLLM's), and none talks to the user's
    Prefect server. Subprocesses inherit it."""
    home = Path(tempfile.mkdtemp(prefix="flexmarl-test-home-"))
    config.stash[HOME] = home
    os.environ.update({
        "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"), "MPLCONFIGDIR": str(home / ".config" / "matplotlib"),
        "HF_HOME": str(home / ".cache" / "huggingface"), "PREFECT_HOME": str(home / ".prefect"),
    })
    for key in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE"):
        os.environ.pop(key, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    home = config.stash.get(HOME, None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


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
def parse_module() -> Callable[[Path], ast.Module]:
    """``ast.parse`` of a source file with the garbage collector held off.

    Python 3.11's AST constructor keeps its recursion depth in interpreter-wide state. A finalizer that runs
    during the parse and parses too (asyncio logging a Dask gather task's unretrieved ``AllExit``: 3.11's
    traceback formatting calls ``ast.parse``) corrupts it: ``SystemError: AST constructor recursion depth
    mismatch`` (CPython gh-106905). CI failed on that at stop 29.
    """

    def parse(path: Path) -> ast.Module:
        gc.disable()  # no gc.collect() first: in a full suite's heap it costs ~0.5 s a file
        try:
            return ast.parse(path.read_text())
        finally:
            gc.enable()

    return parse


@pytest.fixture(scope="session")
def tiny_dir(model_cache: str):
    from flexmarl.models.loading import resolve_model

    return resolve_model("tiny")


SLOW_DIRS = {"reliability": "reliability", "e2e": "e2e", "flows": "flow"}
"""tests/<directory> -> the mark of every test in it (see the module's docstring)."""
SLOW_FIXTURES = {"prefect_api": ("flow",), "tiny_run": ("flow", "cluster")}
"""A fixture -> the marks of every test that uses it, directly or through another fixture."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow groups by directory and fixture (the module's docstring); tests marked ``vllm`` run in
    .venv-vllm (``make test-vllm``), elsewhere they are skipped."""
    from flexmarl.rollout.config import vllm_installed

    tests = Path(__file__).parent
    for item in items:
        try:
            top = item.path.relative_to(tests).parts[0]
        except ValueError:  # a test outside tests/
            top = ""
        marks = {SLOW_DIRS[top]} if top in SLOW_DIRS else set()
        for fixture in SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            marks.update(SLOW_FIXTURES[fixture])
        for mark in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)

    if vllm_installed():
        return
    skip = pytest.mark.skip(reason="vllm not installed (make setup-vllm)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
