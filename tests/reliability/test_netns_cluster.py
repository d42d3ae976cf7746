"""A multi-host cluster on one machine: every Dask message crosses a (virtual) network, and a host dies mid-run.

The Dask scheduler, two workers and the driver (``flexmarl train --dask-address``, with its own Prefect
server) each run in their own network namespace, each with one veth link into a bridge that lives in a
fifth, switch-only namespace; nothing is added to the machine's own network. Mid-run every process of one
worker host is SIGKILLed and its namespace deleted, as if the host lost power: its nanny dies with it, so
nothing restarts it. The run must finish on the surviving host, exactly.

Needs root and ``ip netns``; elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexmarl.bench.chaos_bench import sample_commits
from storage.store import ExperienceStore

ROOT = Path(__file__).resolve().parents[2]
PORT = 8786


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fxprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


class VirtualHosts:
    """Namespaces ``<prefix>-<host>`` on one bridge (in namespace ``<prefix>-sw``), addressed 10.<a>.<b>.<n>/24."""

    def __init__(self, hosts: dict[str, int]) -> None:
        tag = os.getpid() % 100000
        self.prefix = f"fx{tag}"
        self.subnet = f"10.{200 + tag % 50}.{tag // 50 % 250}"
        self.hosts = hosts
        self.switch = f"{self.prefix}-sw"
        self.procs: list[subprocess.Popen] = []

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def create(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns, veth = self.ns(host), f"v{self.hosts[host]}"
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # both ends are created inside their namespaces: nothing appears in the machine's own network
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", veth, "netns", self.switch)
            ip("-n", self.switch, "link", "set", veth, "master", "br0")
            ip("-n", self.switch, "link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def start(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def kill_host(self, host: str) -> None:
        """SIGKILL every process in the host's namespace, then delete the namespace (and its link)."""
        ns = self.ns(host)
        for pid in ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", ns, check=False)

    def destroy(self) -> None:
        for host in self.hosts:
            self.kill_host(host)
        ip("netns", "del", self.switch, check=False)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def wait_for_workers(hosts: VirtualHosts, n: int, timeout_s: float) -> None:
    """Ask the scheduler, from the driver's namespace, until ``n`` workers have joined."""
    probe = (f"from distributed import Client; c = Client('tcp://{hosts.address('sched')}:{PORT}', timeout=10); "
             f"c.wait_for_workers({n}, timeout={timeout_s}); print(sorted(c.scheduler_info()['workers']))")
    res = subprocess.run(["ip", "netns", "exec", hosts.ns("drv"), sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=timeout_s + 30)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_run_across_network_namespaces_survives_losing_a_host(
    tmp_path: Path, settings: list[str], tiny_config, assert_exact, weights_of
) -> None:
    reason = namespaces_unavailable()
    if reason:
        print(f"skipping the multi-host test: {reason}")
        pytest.skip(reason)
    cfg = tiny_config()
    hosts = VirtualHosts({"sched": 1, "w1": 2, "w2": 3, "drv": 10})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PREFECT_HOME": str(tmp_path / "prefect-home")})
    scheduler = f"tcp://{hosts.address('sched')}:{PORT}"
    run_dir = tmp_path / "run"
    try:
        hosts.create()
        hosts.start("sched", [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                              hosts.address("sched"), "--port", str(PORT), "--no-dashboard"], env,
                    tmp_path / "scheduler.log")
        for worker in ("w1", "w2"):
            hosts.start(worker, [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--host",
                                 hosts.address(worker), "--nthreads", "1", "--no-dashboard", "--name", worker],
                        env, tmp_path / f"{worker}.log")
        wait_for_workers(hosts, 2, timeout_s=120)

        sets = [arg for s in settings for arg in ("--set", s)]
        driver = hosts.start("drv", [sys.executable, "-m", "flows.cli", "train", "--preset", "tiny", "--run-dir",
                                     str(run_dir), "--dask-address", scheduler, *sets], env, tmp_path / "driver.log")
        # mid-run: step 0 is committed and step 1 under way; then host w2 loses power
        store = ExperienceStore(run_dir / "store")
        deadline = time.time() + 600
        while time.time() < deadline and driver.poll() is None:
            if sample_commits(store, list(cfg.agents)) >= 5:
                break
            time.sleep(0.05)
        killed_at = time.time()
        hosts.kill_host("w2")
        driver.wait(timeout=600)
        log = (tmp_path / "driver.log").read_text()
        assert driver.returncode == 0, log[-4000:]
    finally:
        hosts.destroy()
    assert ip("netns", "list").stdout.count(hosts.prefix) == 0  # nothing left behind

    report = json.loads((run_dir / "report.json").read_text())
    lost = f"tcp://{hosts.address('w2')}"
    recoveries = [r for r in report["recoveries"] if any(w.startswith(lost) for w in r["workers"])]
    assert recoveries and recoveries[0]["recovered_s"] is not None, report["recoveries"]
    assert report["pipeline_s"] > 0 and killed_at > 0
    # every worker the run used sat behind the virtual network
    assert all(w.startswith(f"tcp://{hosts.subnet}.") for w in report["worker_utilization"])
    assert_exact(run_dir, cfg, weights_of(run_dir, cfg))

