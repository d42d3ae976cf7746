"""One Prefect API for a run: the one in PREFECT_API_URL, or a local server started for the run.

Without an API URL, Prefect would start a temporary server in every process that runs a flow or task; a
run started from the command line instead starts one real server on 127.0.0.1 and stops it at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_fixed


class PrefectAPIError(RuntimeError):
    """The Prefect API cannot be reached or started."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_api(url: str, *, timeout_s: float = 10.0) -> None:
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise PrefectAPIError(
            f"the Prefect API at {url} does not answer ({exc}); start it with `prefect server start` "
            "or unset PREFECT_API_URL to let the run start its own"
        ) from None


@contextmanager
def prefect_api(*, startup_timeout_s: float = 90.0) -> Iterator[str]:
    """Yield the URL of a reachable Prefect API, starting a local server when none is configured."""
    configured = PREFECT_API_URL.value()
    if configured:
        check_api(configured)
        yield configured
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        _wait_healthy(url, server, startup_timeout_s)
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                # send buffered logs and events while the server still runs; afterwards they would be
                # retried against a dead server at interpreter exit
                APILogWorker.drain_all(timeout=10)
                EventsWorker.drain_all(timeout=10)
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    @retry(retry=retry_if_exception_type(PrefectAPIError), wait=wait_fixed(0.5), stop=stop_after_delay(timeout_s),
           reraise=True)
    def poll() -> None:
        if server.poll() is not None:
            err = server.stderr.read().decode(errors="replace")[-2000:] if server.stderr else ""
            raise RuntimeError(f"the local Prefect server exited with code {server.returncode}: {err}")
        check_api(url, timeout_s=2.0)

    poll()
