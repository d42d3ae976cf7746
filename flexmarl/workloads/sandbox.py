"""Running model-written Python in a child process with a timeout and resource limits, never in-process.

``run_python(source)`` writes the program into a fresh scratch directory and runs it there with the same
interpreter, isolated (``-I -S -B``: no site-packages, no user paths, no ``PYTHONPATH``, no bytecode
files) and a minimal
environment. Before the program runs, the child:

1. leaves the network: it tries ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` (a private network namespace
   with no interfaces); where the kernel refuses, the audit hook below still blocks sockets;
2. sets its limits: CPU seconds, address space, file size, no child processes;
3. installs an audit hook (PEP 578, which cannot be removed) that refuses sockets, subprocesses, signals
   to other processes, loading native libraries, and any write, delete or rename outside the scratch
   directory.

The parent kills the child's whole process group at the wall-clock timeout. This guards against
accidents of generated code (endless loops, memory blow-ups, stray writes); it is not a security
boundary against code written to escape, which needs a container or a VM.

Example:
    >>> run_python("print(1 + 1)").stdout
    '2\\n'
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock limit; the process group is killed after it."""
    cpu_s: int = 5
    """CPU-time limit (RLIMIT_CPU): the kernel stops the process after it."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS): allocations beyond it raise MemoryError."""
    file_mb: int = 8
    """Largest file the program may write (RLIMIT_FSIZE), its captured output included."""
    output_chars: int = 20_000
    """Most characters of stdout and of stderr kept in the result."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool  # the child got its own empty network namespace (else only the audit hook)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs in the child before the program; argv: cpu_s, memory bytes, file bytes, program path.
BOOTSTRAP = r"""
import os, resource, sys

def _isolate_network():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
        return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWNET) == 0
    except Exception:
        return False

_isolated = _isolate_network()
print("NET_ISOLATED" if _isolated else "NET_SHARED", file=sys.stderr, flush=True)
_cpu, _mem, _fsize, _path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

_scratch = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_REFUSED = (
    "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "pty.", "ctypes.", "_ctypes.", "winreg.", "resource.setrlimit", "sys.addaudithook",
)
_PATH_EVENTS = {  # event -> positions of the path arguments it changes
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.chmod": (0,),
    "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
    "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.move": (0, 1), "os.chdir": (0,),
}

def _inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor: its opening was checked
    real = os.path.realpath(os.fsdecode(path))
    return real == _scratch or real.startswith(_scratch + os.sep)

def _guard(event, args):
    if event.startswith(_REFUSED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the scratch directory")
    elif event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the scratch directory")

with open(_path, encoding="utf-8") as _fh:
    _code = compile(_fh.read(), "program.py", "exec")
sys.argv = ["program.py"]
sys.addaudithook(_guard)
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""

NETWORK_MARKERS = ("NET_ISOLATED\n", "NET_SHARED\n")


def run_python(source: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``source`` as a Python program in a child process under ``limits``; never raises for its failures.

    Args:
        source: the whole program.
        limits: time, CPU, memory, file-size and output limits.

    Returns:
        The exit status (``ok`` when it exited 0 in time) and the start of its stdout and stderr.
    """
    with tempfile.TemporaryDirectory(prefix="flexmarl-sandbox-") as root:
        scratch = Path(root) / "scratch"  # the program's cwd; its output files live beside it, out of reach
        scratch.mkdir()
        program = scratch / "program.py"
        program.write_text(source, encoding="utf-8")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(scratch),
            "TMPDIR": str(scratch),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            # a dead proxy, for libraries that honour it, in case the namespace and the hook both fail
            "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": "",
        }
        args = [
            sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, str(limits.cpu_s), str(limits.memory_mb * 2**20),
            str(limits.file_mb * 2**20), str(program),
        ]
        out_path, err_path = Path(root) / "stdout", Path(root) / "stderr"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            # start_new_session: the timeout kills the whole process group. No preexec_fn: it is unsafe in a
            # process with threads (the driver has Dask's), so the child sets its own limits in BOOTSTRAP.
            proc = subprocess.Popen(
                args, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                returncode = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                returncode = proc.wait(timeout=limits.timeout_s)  # SIGKILL cannot be caught: this returns
        stdout = _read_start(out_path, limits.output_chars)
        stderr = _read_start(err_path, limits.output_chars + len(NETWORK_MARKERS[1]))
    isolated = stderr.startswith(NETWORK_MARKERS[0])
    for marker in NETWORK_MARKERS:
        stderr = stderr.removeprefix(marker)
    return SandboxResult(returncode, stdout, stderr[: limits.output_chars], timed_out, isolated)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it exited between the timeout and the kill


def _read_start(path: Path, chars: int) -> str:
    with path.open("rb") as fh:
        return fh.read(chars * 4).decode("utf-8", errors="replace")[:chars]
