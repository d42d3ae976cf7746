"""A retried append never writes twice, even when the retry runs in another process (a re-run Dask task)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from storage.store import ExperienceStore

APPEND = """
import sys
sys.path.insert(0, {tests!r})
from conftest import rows  # tests/storage/conftest.py
from storage.store import ExperienceStore
commit = ExperienceStore({root!r}).append_samples(
    "solver", rows("solver", ["q_0_0", "q_0_1", "q_0_2"]), app_id="rollout:solver", seq=7)
print("skipped" if commit.skipped else "written", commit.version)
"""


def append_in_process(root: str) -> subprocess.Popen:
    script = APPEND.format(tests=str(Path(__file__).parent), root=root)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_a_task_retried_in_a_new_process_writes_nothing_twice(tmp_path) -> None:
    root = str(tmp_path / "store")
    ExperienceStore(root).create(["solver"])
    first = append_in_process(root)
    out1, _ = first.communicate(timeout=120)
    # the worker "died" after committing; the scheduler re-runs the task elsewhere
    retry = append_in_process(root)
    out2, _ = retry.communicate(timeout=120)
    assert (first.returncode, retry.returncode) == (0, 0)
    assert out1.split()[0] == "written" and out2.split()[0] == "skipped"
    assert out1.split()[1] == out2.split()[1]  # the retry reports the original commit's version
    assert ExperienceStore(root).read_samples("solver")["sample_id"].to_pylist() == ["q_0_0", "q_0_1", "q_0_2"]


def test_the_same_append_racing_in_three_processes_is_stored_once(tmp_path) -> None:
    root = str(tmp_path / "store")
    ExperienceStore(root).create(["solver"])
    procs = [append_in_process(root) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sorted(o.split()[0] for o in outs) == ["skipped", "skipped", "written"]
    store = ExperienceStore(root)
    assert store.read_samples("solver").num_rows == 3
    assert store.open("samples/solver").transaction_version("rollout:solver") == 7
