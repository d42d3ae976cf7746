"""The disk-full test's filler can write only to the test's own tmpfs, and only while its test wants it to.

These need no root: they show the filler refusing what a lazy unmount once made of its path (the real disk).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .small_disk import Filler, NotOwnDisk, SmallDisk


def test_a_directory_of_the_real_disk_is_not_taken_for_the_test_s_own() -> None:
    with pytest.raises(NotOwnDisk, match="not a mount point"):
        SmallDisk.at(Path(__file__).parent)
    with pytest.raises(NotOwnDisk, match="MiB, not the test's own tmpfs"):
        SmallDisk.at(Path("/dev/shm"))  # a tmpfs, but the size of the machine's memory


def test_the_filler_writes_nothing_where_its_tmpfs_is_gone(tmp_path: Path) -> None:
    # the tmpfs unmounted from under the path: the path now leads to another device (the real disk)
    gone = SmallDisk(tmp_path, device=os.stat(tmp_path).st_dev + 1)
    filler = Filler(gone, lambda: True, deadline_s=60).start()
    filler.stop()
    assert isinstance(filler.error, NotOwnDisk), filler.error
    assert filler.written == 0 and not filler.ballast.exists()


def test_the_filler_ends_by_itself_at_its_deadline_without_writing(tmp_path: Path) -> None:
    filler = Filler(SmallDisk(tmp_path, os.stat(tmp_path).st_dev), lambda: False, deadline_s=0.2).start()
    filler.join(timeout_s=10)  # not stopped: it must end on its own
    assert not filler.alive and filler.error is None and filler.written == 0 and not filler.ballast.exists()
