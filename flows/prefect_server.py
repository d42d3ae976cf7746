"""One Prefect API for a run: the one in PREFECT_API_URL, or a local server started for the run.

Without an API URL, Prefect would start a temporary server in every process that runs a flow or task; a
run started from the command line instead starts one real server on 127.0.0.1, with its UI (the flow run's
"View at" link opens there while the run lasts), and stops it at the end. That server keeps its database
where any `prefect server start` does, ``$PREFECT_HOME/prefect.db`` (``~/.prefect`` by default), so a later
`prefect server start` on the same home shows the finished run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

import httpx
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings
from tenacity import retry, retry_if_exception, stop_after_delay, wait_fixed


class PrefectAPIError(RuntimeError):
    """The Prefect API cannot be reached or started."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_api(url: str, *, timeout_s: float = 10.0) -> None:
    """Fail within ``timeout_s`` unless the Prefect API at ``url`` answers its health check."""
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        reason = f"no answer within {timeout_s:.0f}s" if isinstance(exc, httpx.TimeoutException) else str(exc)
        raise PrefectAPIError(
            f"the Prefect API at {url} does not answer ({reason}); start it with `prefect server start` "
            "or unset PREFECT_API_URL to let the run start its own"
        ) from None


def server_command(port: int) -> list[str]:
    """The command that starts the run's own Prefect server: on the loopback interface only (to serve other
    hosts, start a server yourself and set PREFECT_API_URL)."""
    return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]


@contextmanager
def prefect_api(*, startup_timeout_s: float = 90.0,
                on_server_exit: Callable[[str, int], None] | None = None) -> Iterator[str]:
    """Yield the URL of a reachable Prefect API, starting a local server when none is configured.

    ``on_server_exit(url, returncode)`` is called from a watcher thread if the server started here exits while
    the context is open (it was killed: nothing else stops it). Without it, the run finds out through the
    Prefect client, whose retries against the dead server take minutes."""
    configured = PREFECT_API_URL.value()
    if configured:
        check_api(configured)
        yield configured
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    # the UI asks PREFECT_UI_API_URL for its API; left unset, it would ask port 4200, not this server's
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true",
           "PREFECT_UI_API_URL": url}
    # stderr goes to a file, not a pipe: a pipe nobody reads fills up during a long run and stalls the server
    with tempfile.TemporaryFile() as stderr:
        server = subprocess.Popen(
            server_command(port), env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )
        watchdog = start_watchdog(server.pid)
        closing = threading.Event()
        try:
            _wait_healthy(url, server, stderr, startup_timeout_s)
            if on_server_exit is not None:
                threading.Thread(target=_watch_server, args=(server, url, closing, on_server_exit),
                                 name="prefect-server-watch", daemon=True).start()
            with temporary_settings({PREFECT_API_URL: url}):
                try:
                    yield url
                finally:
                    # send buffered logs and events while the server still runs; afterwards they would be
                    # retried against a dead server at interpreter exit
                    APILogWorker.drain_all(timeout=10)
                    EventsWorker.drain_all(timeout=10)
        finally:
            closing.set()
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=15)
            watchdog.kill()
            watchdog.wait(timeout=15)


# Ends the server's process group once the driver is gone, even after kill -9 of the driver, which runs no
# finally block. The server has its own session (so that Ctrl-C reaches the driver, which then drains the logs
# and stops it), so nothing else would end it. Polling getppid: the watchdog is re-parented when its parent dies.
WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        break
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.2)
"""


def _watch_server(server: subprocess.Popen, url: str, closing: threading.Event,
                  on_exit: Callable[[str, int], None]) -> None:
    while not closing.wait(0.5):
        if server.poll() is not None:
            if not closing.is_set():
                on_exit(url, server.returncode)
            return


def start_watchdog(server_pid: int) -> subprocess.Popen:
    """A process that ends the server's process group (``server_pid``'s) when this process dies."""
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(server_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def _wait_healthy(url: str, server: subprocess.Popen, stderr: IO[bytes], timeout_s: float) -> None:
    """Wait until the server started for the run answers; fail with its last output if it exits or stalls."""

    def last_output() -> str:
        stderr.seek(0)
        return stderr.read().decode(errors="replace")[-2000:]

    # retry while the server runs and does not answer yet; a server that exited is final
    @retry(retry=retry_if_exception(lambda e: isinstance(e, PrefectAPIError) and server.poll() is None),
           wait=wait_fixed(0.5), stop=stop_after_delay(timeout_s), reraise=True)
    def poll() -> None:
        if server.poll() is not None:
            raise PrefectAPIError(
                f"the local Prefect server exited with code {server.returncode} before it answered: {last_output()}"
            )
        check_api(url, timeout_s=2.0)

    try:
        poll()
    except PrefectAPIError as exc:
        if server.poll() is not None:
            raise
        raise PrefectAPIError(
            f"the local Prefect server at {url} did not answer within {timeout_s:.0f}s ({exc}); set PREFECT_API_URL "
            f"to a running server (`prefect server start`). Its output: {last_output()}"
        ) from None
