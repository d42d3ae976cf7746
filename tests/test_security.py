"""Security defaults: loopback-only services, no pickle from the store or the network, generated code only in
the sandbox (no network, limits, a scratch directory), and only registered functions in a config.

docs/operations.md (Security) describes the same; a config naming an unregistered function is refused in
tests/test_bad_input.py (``unregistered-function``), a pickled model in ``pickled-weights``.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from flexmarl.workloads.sandbox import SandboxLimits, run_python

ROOT = Path(__file__).resolve().parents[1]
PICKLERS = {"pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal", "_pickle"}


@pytest.mark.cluster
def test_the_local_cluster_binds_scheduler_workers_and_dashboard_to_loopback() -> None:
    from distributed import Client

    from flexmarl.cluster.config import ClusterConfig
    from flexmarl.cluster.local import open_cluster

    with open_cluster(ClusterConfig(n_workers=1)) as address, Client(address) as client:
        info = client.scheduler_info(n_workers=-1)
        assert address.startswith("tcp://127.0.0.1:")
        assert info["workers"] and all(w.startswith("tcp://127.0.0.1:") for w in info["workers"])
        assert client.dashboard_link.startswith("http://127.0.0.1:")


def test_the_runs_own_prefect_server_listens_on_loopback_only() -> None:
    from flows.prefect_server import free_port, server_command

    port = free_port()
    command = server_command(port)
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[-1] == str(port)


@pytest.mark.parametrize("layer", ["flexmarl", "storage", "tasks", "flows", "deployments"])
def test_no_module_unpickles(layer: str, parse_module) -> None:
    """Nothing imports a pickle library or calls torch.load: store data is Arrow, states are safetensors."""
    found = []
    for path in (ROOT / layer).rglob("*.py"):
        for node in ast.walk(parse_module(path)):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLERS:
                found.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") == "torch":
                found.append(f"{path.name}: torch.load")
    assert not found, found


def test_store_schemas_hold_arrow_values_not_blobs() -> None:
    import pyarrow as pa

    from storage.schema import EPISODE_SCHEMA, SAMPLE_SCHEMA, UPDATE_SCHEMA

    for schema in (SAMPLE_SCHEMA, EPISODE_SCHEMA, UPDATE_SCHEMA):
        blobs = [f.name for f in schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        assert not blobs, f"binary columns could carry pickles: {blobs}"


def kernel_allows_network_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not kernel_allows_network_namespaces(), reason="no user/network namespaces here: the audit "
                    "hook alone blocks sockets (tests/flexmarl/workloads/test_sandbox.py)")
def test_generated_code_runs_without_a_network() -> None:
    res = run_python("print(open('/proc/self/net/dev').read())")
    assert res.ok and res.network_isolated
    interfaces = [line.split(":")[0].strip() for line in res.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]  # a fresh namespace: no way out, not even to this host's services


def test_generated_code_runs_under_limits_in_a_scratch_directory_that_is_removed() -> None:
    limits = SandboxLimits(cpu_s=3, memory_mb=300, file_mb=2)
    res = run_python(
        "import os, resource\nprint(os.getcwd())\n"
        "print(*(resource.getrlimit(getattr(resource, 'RLIMIT_' + r))[0] for r in ('CPU', 'AS', 'FSIZE', 'NPROC')))",
        limits=limits,
    )
    assert res.ok, res.stderr
    cwd, rlimits = res.stdout.splitlines()
    assert Path(cwd).name == "scratch" and "flexmarl-sandbox-" in cwd
    assert not Path(cwd).exists()  # removed with everything the program wrote
    assert rlimits.split() == [str(3), str(300 * 2**20), str(2 * 2**20), "0"]
