"""A process's memory as the benchmarks read it: resident now, and the peak since the process started or since
``reset_peak_rss``.

The peak is Linux's ``VmHWM`` (``/proc/self/status``), not ``getrusage``'s ``ru_maxrss``: that one survives
``exec``, so a worker that a large process spawned reports the spawner's peak (a Dask nanny forked from a driver
holding 14 GB of models read 14 GB before it loaded anything).
"""

from __future__ import annotations

from pathlib import Path

import psutil

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started (or since ``reset_peak_rss``)."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: the peak is read on Linux only")


def reset_peak_rss() -> None:
    """Start the peak afresh from what is resident now (Linux: '5' to ``clear_refs``)."""
    _CLEAR.write_text("5")
