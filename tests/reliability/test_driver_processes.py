"""The run's own processes never outlive `flexmarl train`, and a wrong --dask-address never hangs it.

Real processes: the CLI starts its own Prefect server (no PREFECT_API_URL) and LocalCluster, and the driver is
then killed with SIGKILL (no clean-up runs: the watchdog must end the server, the workers their own process)
or SIGTERM (the CLI's handler stops both). The subprocess timeouts are hang detectors, not speed targets.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
FLEXMARL = [sys.executable, "-m", "flows.cli"]


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # the run's own server keeps its database here
    return env


def wait_for_cluster(driver: subprocess.Popen, log: Path, timeout_s: float = 400) -> list[psutil.Process]:
    """The driver's descendants once its Prefect server answers and its Dask workers run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert driver.poll() is None, log.read_text()[-3000:]
        kids = psutil.Process(driver.pid).children(recursive=True)
        cmdlines = [" ".join(k.cmdline()) for k in kids if k.is_running()]
        server = any("prefect" in c and "server" in c for c in cmdlines)
        workers = sum("multiprocessing" in c or "spawn" in c for c in cmdlines)
        if server and workers >= 2 and "engines:" in log.read_text():
            # a watchdog started in its own session is not a child; find it by its arguments
            return kids + [p for p in psutil.process_iter(["cmdline"])
                           if str(driver.pid) in " ".join(p.info["cmdline"] or []) and "killpg" in
                           " ".join(p.info["cmdline"] or [])]
        time.sleep(1)
    raise AssertionError(f"the run did not start its server and cluster: {log.read_text()[-3000:]}")


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def assert_all_end(procs: list[psutil.Process], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(procs), alive(procs)


def kill_all(procs: list[psutil.Process]) -> None:
    """A failed test leaves nothing behind."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_server_and_the_cluster_end_with_the_driver(sig: signal.Signals, tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    with log.open("w") as out:
        driver = subprocess.Popen(
            [*FLEXMARL, "train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--set", "run.steps=50"],
            cwd=ROOT, env=cli_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)
    procs = wait_for_cluster(driver, log)
    try:
        driver.send_signal(sig)
        driver.wait(timeout=120)
        assert_all_end(procs)
        if sig == signal.SIGTERM:  # it stopped them itself, and said nothing a user should not see
            text = log.read_text()
            assert driver.returncode == 128 + signal.SIGTERM and "Traceback" not in text, text[-3000:]
            assert "stopped by SIGTERM; continue the run with `flexmarl train --resume" in text
    finally:
        kill_all(procs)


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_an_address_where_an_http_server_listens_is_refused_within_the_bound(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        res = subprocess.run(
            [*FLEXMARL, "train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
             "--dask-address", f"tcp://127.0.0.1:{server.server_port}", "--set", "cluster.connect_timeout_s=3"],
            cwd=ROOT, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
        server.server_close()
    assert res.returncode == 2, res.stderr[-3000:]
    assert "does not answer as a Dask scheduler within 3s" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


def test_the_prefect_server_killed_mid_run_stops_it_with_one_line_and_it_resumes(tmp_path: Path) -> None:
    log, run_dir = tmp_path / "driver.log", tmp_path / "run"
    with log.open("w") as out:
        driver = subprocess.Popen(
            [*FLEXMARL, "train", "--preset", "tiny", "--run-dir", str(run_dir), "--set", "run.steps=12"],
            cwd=ROOT, env=cli_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)
    procs = wait_for_cluster(driver, log)
    try:
        server = next(p for p in procs if "server" in " ".join(p.cmdline()) and "prefect" in " ".join(p.cmdline()))
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # the server and its uvicorn, as an OOM kill would
        driver.wait(timeout=600)
        text = log.read_text()
        assert driver.returncode == 1, text[-3000:]
        tail = text[-2000:]  # the last thing printed: one line
        # the run saw its own server end, instead of waiting out the Prefect client's retries (minutes)
        assert "stopped answering (its server was killed by SIGKILL)" in tail, text[-3000:]
        assert f"flexmarl train --resume {run_dir}" in tail
        assert_all_end(procs)
    finally:
        kill_all(procs)
    resumed = subprocess.run([*FLEXMARL, "train", "--resume", str(run_dir)], cwd=ROOT, env=cli_env(tmp_path),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    verify = subprocess.run([*FLEXMARL, "store", "verify", str(run_dir)], cwd=ROOT, env=cli_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
