"""The sandbox that runs model-written code: each limit holds, and nothing escapes into the caller."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.workloads.sandbox import SandboxLimits, run_python


def test_a_clean_program_runs_and_its_output_comes_back() -> None:
    res = run_python("import math\nprint(math.factorial(5))")
    assert res.ok and res.stdout == "120\n" and res.stderr == ""


def test_a_failing_program_reports_its_error() -> None:
    res = run_python("assert 1 == 2, 'nope'")
    assert not res.ok and res.returncode == 1 and "AssertionError: nope" in res.stderr


def test_an_endless_loop_is_killed_at_the_timeout() -> None:
    res = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=1.0, cpu_s=30))
    assert res.timed_out and not res.ok and res.returncode < 0


def test_the_cpu_limit_stops_a_busy_program() -> None:
    res = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=60.0, cpu_s=1))
    assert not res.timed_out and not res.ok and res.returncode < 0  # killed by the kernel (SIGXCPU/SIGKILL)


def test_allocating_beyond_the_memory_limit_fails() -> None:
    res = run_python("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", limits=SandboxLimits(memory_mb=256))
    assert not res.ok and "MemoryError" in res.stderr and "allocated" not in res.stdout


def test_writes_stay_inside_the_scratch_directory(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    res = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not res.ok and "outside the scratch directory" in res.stderr
    assert not target.exists()
    res = run_python("import os\nos.makedirs('sub')\nopen('sub/f.txt', 'w').write('ok')\n"
                     "print(open('sub/f.txt').read())")
    assert res.ok and res.stdout == "ok\n"


def test_deleting_or_renaming_outside_the_scratch_directory_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    for program in (f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, 'mine')"):
        res = run_python(program)
        assert not res.ok and "outside the scratch directory" in res.stderr
    assert victim.read_text() == "keep"


@pytest.mark.parametrize(
    "program",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.kill(1, 0)",
    ],
)
def test_network_processes_and_signals_are_refused(program: str) -> None:
    res = run_python(program)
    assert not res.ok and "sandbox:" in res.stderr and "is not allowed" in res.stderr


def test_a_flood_of_output_is_cut_and_does_not_fill_the_disk() -> None:
    res = run_python("import sys\nsys.stdout.write('x' * (64 * 1024 * 1024))", limits=SandboxLimits(file_mb=1))
    assert not res.ok and len(res.stdout) <= SandboxLimits().output_chars


def test_the_program_sees_no_site_packages_and_no_caller_environment(monkeypatch) -> None:
    monkeypatch.setenv("FLEXMARL_SECRET", "s3cret")
    res = run_python("import os, sys\nprint(os.environ.get('FLEXMARL_SECRET'))\nimport torch")
    assert res.stdout == "None\n" and "ModuleNotFoundError" in res.stderr
