"""The one line for a run stopped by a full disk or a lost Prefect API (flows/run_failures.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from prefect.settings import PREFECT_API_URL

from flows.prefect_server import free_port
from flows.run_failures import explain_failure


def raised_from(cause: BaseException) -> RuntimeError:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise RuntimeError("the snapshot task failed") from inner
    except RuntimeError as outer:
        return outer


def test_a_full_disk_anywhere_in_the_chain_is_named_with_the_way_on(prefect_api, tmp_path: Path) -> None:
    api = PREFECT_API_URL.value()
    line = explain_failure(raised_from(OSError(errno.ENOSPC, "No space left on device")), api, tmp_path)
    assert line.startswith("the run stopped: the disk is full (OSError: [Errno 28] No space left on device)")
    assert f"free space under {tmp_path.resolve()}, then continue it with `flexmarl train --resume {tmp_path}`" in line
    # delta-rs and safetensors say it in their own words
    rust = explain_failure(ValueError("I/O error: No space left on device (os error 28)"), api, tmp_path)
    assert rust is not None and "the disk is full" in rust


def test_an_api_that_stopped_answering_is_named_and_other_errors_are_left_alone(prefect_api, tmp_path: Path) -> None:
    gone = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    line = explain_failure(ConnectionError("[Errno 111] Connection refused"), gone, tmp_path)
    assert line.startswith(f"the run stopped: the Prefect API at {gone} stopped answering (ConnectionError: ")
    assert f"`flexmarl train --resume {tmp_path}`" in line
    # a live API: a real error, raised
    assert explain_failure(KeyError("a bug"), PREFECT_API_URL.value(), tmp_path) is None
