"""A small filesystem of a test's own, filled to the last byte on cue: a real ENOSPC, and nothing written elsewhere.

A suite once filled a machine's disk with 63 GB: a filler thread outlived its test, and after its deadline it
opened its ballast by path, by then on the real disk under a lazily unmounted tmpfs. Here the filler writes only
to a file whose filesystem it has checked is the tmpfs it was given (device and size, on the open file itself),
stops at its deadline or when told, and the fixture that owns it joins it before unmounting.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DISK_BYTES = 64 << 20
CHUNK = bytes(1 << 16)


class NotOwnDisk(RuntimeError):
    """The path is not on the small filesystem the test mounted for itself: nothing may be written there."""


@dataclass(frozen=True)
class SmallDisk:
    """A mounted filesystem of at most ``DISK_BYTES``; ``device`` is its ``st_dev`` as read right after mounting."""

    path: Path
    device: int

    @classmethod
    def at(cls, path: Path) -> SmallDisk:
        """The filesystem mounted at ``path``, checked to be small and not its parent's.

        Raises:
            NotOwnDisk: ``path`` is on its parent's filesystem, or on one larger than ``DISK_BYTES``.
        """
        device = os.stat(path).st_dev
        if device == os.stat(path.parent).st_dev:
            raise NotOwnDisk(f"{path} is not a mount point: it is on the same filesystem as {path.parent}")
        disk = cls(path, device)
        disk.check(os.statvfs(path), device)
        return disk

    def check(self, vfs: os.statvfs_result, device: int) -> None:
        """Raise ``NotOwnDisk`` unless ``device`` is this disk's and ``vfs`` is no larger than ``DISK_BYTES``."""
        size = vfs.f_blocks * vfs.f_frsize
        if device != self.device or size > DISK_BYTES:
            raise NotOwnDisk(f"refusing to fill {self.path}: it is on device {device} of {size >> 20} MiB, not the "
                             f"test's own tmpfs (device {self.device}, at most {DISK_BYTES >> 20} MiB)")


@contextmanager
def mounted_small_disk(path: Path) -> Iterator[SmallDisk]:
    """Mount a ``DISK_BYTES`` tmpfs at ``path`` for the block, then unmount it (needs root).

    Raises:
        PermissionError: the mount was refused (the caller skips).
    """
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield SmallDisk.at(path)
    finally:
        # not `umount -l`: a lazily unmounted tmpfs leaves its path on the real disk for anything still open
        subprocess.run(["umount", str(path)], check=True, capture_output=True)


class Filler:
    """A thread that fills ``disk`` once ``ready()`` holds: writes zeros to ``disk/ballast`` until ENOSPC.

    It writes nothing if ``ready()`` has not held by ``deadline_s`` or ``stop()`` came first, never writes after
    either, and writes only to a ballast whose open file it has checked is on ``disk``.
    """

    def __init__(self, disk: SmallDisk, ready: Callable[[], bool], *, deadline_s: float) -> None:
        self.disk, self.ready = disk, ready
        self.ballast = disk.path / "ballast"
        self.deadline = time.monotonic() + deadline_s
        self.written = 0
        self.full = threading.Event()  # the disk is full: the run's next write fails
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-filler", daemon=True)

    def start(self) -> Filler:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30) -> None:
        """Stop it and wait for its thread to end.

        Raises:
            RuntimeError: the thread is still alive after ``timeout_s``.
        """
        self._stop.set()
        self.join(timeout_s)
        if self.alive:
            raise RuntimeError(f"the disk filler of {self.disk.path} did not stop within {timeout_s:.0f}s")

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _go_on(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self.deadline

    def _run(self) -> None:
        try:
            while not self.ready():
                if not self._go_on():
                    return
                self._stop.wait(0.05)
            if not self._go_on():
                return
            self.disk.check(os.statvfs(self.disk.path), os.stat(self.disk.path).st_dev)
            fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                self.disk.check(os.fstatvfs(fd), os.fstat(fd).st_dev)  # the file itself, wherever the path led
                while self._go_on():
                    try:
                        self.written += os.write(fd, CHUNK)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        self.full.set()
                        return
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
