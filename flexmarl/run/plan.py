"""A run's plan: what starting a run in a run directory will do, decided (and checked) once, writing nothing.

``flexmarl train`` and the training flow plan the same way. ``locked_plan`` takes the run directory's lock
and calls ``plan_run``, which reads the config (new, resumed, or the one a retried Prefect flow run started
with), checks what it names (``preflight``: models, data, the workers' Python, tracking, a Dask address)
and where it writes, and what the directory holds: nothing, an earlier start that failed before its first
commit (taken over), or a run to continue, whose store must pass ``flexmarl store verify``. It returns a
frozen ``RunPlan`` or raises one error per cause, each naming the fix:

    ConfigError        a bad config; a resume of no run, or one that changes what its samples were made under
    RunLocationError   the run directory or the store cannot be written
    RunDirError        a new run in a directory that holds one
    ResumeRefused      the store of the run to resume fails verify
    ModelError, DataError, WorkerPythonError, TrackingError, ClusterError   what the config names is unusable
    RunLockError       another process runs in the directory

``prepare.py`` carries a plan out (takes over a failed start, writes the config and the attempt, creates the
store). The lock holds from the plan to the end of the run, so the directory cannot change in between. Like
the lock, a plan is re-entrant: `flexmarl train` plans (so checks everything) before it starts Prefect, and
the flow it then runs, asking for the same run inside that block, gets that plan without checking again.

Example:
    >>> with locked_plan(RunRequest("runs/tiny", preset="tiny")) as plan:
    ...     run = prepare(plan)  # flexmarl.run.prepare
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path

from flexmarl.cluster.local import connect
from flexmarl.config import ConfigError, RunConfig, dotted_values, load_config
from flexmarl.preflight import check_inputs, check_run_dir, check_run_location, check_store_location
from flexmarl.run.layout import ATTEMPTS_FILE, CONFIG_FILE
from flexmarl.run_lock import run_lock
from flexmarl.run_start import check_resumable, never_committed
from flexmarl.tracking.tracker import check_tracking

# What a resumed run may change: where and how patiently it runs, and how far. The rest made its samples.
RESUMABLE = ("cluster.*", "rollout.request_timeout_s", "rollout.sync_timeout_s", "run.steps",
             "run.save_checkpoints", "training.max_slots", "agents.*.training.max_slots")


class RunDirError(RuntimeError):
    """A new run in a directory that already holds one; the message names ``--resume`` as the fix."""


class Start(StrEnum):
    NEW = "new"
    RESUMED = "resumed"  # `flexmarl train --resume`, or the flow's `resume` parameter
    RETRIED = "retried"  # a later attempt of the Prefect flow run that started the run


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to be: the command line's or the flow's parameters.

    ``run_dir`` is as given (messages name it so); ``overrides`` hold every ``dotted.key=value``, the flow's
    typed settings and ``cluster.address`` included (``config.run_overrides``).
    """

    run_dir: str
    config: str | None = None  # a config file; else ``preset``, else the default preset
    preset: str | None = None
    overrides: tuple[str, ...] = ()
    resume: bool = False  # continue the run in ``run_dir``
    retry_of: str | None = None  # the Prefect flow run this is a later attempt of


@dataclass(frozen=True)
class RunPlan:
    """A start that passed every check: what ``prepare`` carries out."""

    request: RunRequest
    cfg: RunConfig
    run_dir: Path  # resolved
    store_uri: str
    start: Start
    takes_over: bool = False  # the directory holds a start that failed before its first commit: cleared first

    @property
    def resumes(self) -> bool:
        return self.start is not Start.NEW


_held: ContextVar[RunPlan | None] = ContextVar("flexmarl_held_plan", default=None)  # the innermost block's


@contextmanager
def locked_plan(request: RunRequest) -> Iterator[RunPlan]:
    """Hold the run directory's lock and yield the run's plan; the lock holds until the block ends.

    Inside the block (same thread or its copied context), ``locked_plan`` of an equal request yields the same
    plan; another request (a retry's) is planned afresh.

    Raises:
        RunLocationError: the run directory cannot be written (before the lock, which creates it).
        RunLockError: another process holds the lock; and what ``plan_run`` raises.
    """
    held = _held.get()
    if held is not None and held.request == request:
        with run_lock(request.run_dir):  # held already: only counts up
            yield held
        return
    check_run_dir(request.run_dir)
    with run_lock(request.run_dir):
        plan = plan_run(request)
        token = _held.set(plan)
        try:
            yield plan
        finally:
            _held.reset(token)


def held_plan() -> RunPlan | None:
    """The plan of the innermost ``locked_plan`` block around this call, if any."""
    return _held.get()


def plan_run(request: RunRequest) -> RunPlan:
    """The plan of ``request``. Call it under the run directory's lock (``locked_plan``), which also proves the
    directory writable: the state it reads must not change before the plan is carried out."""
    run_dir = Path(request.run_dir)
    start = _start_of(request)
    cfg = _config(request, start)
    store_uri = check_store_location(cfg, run_dir)
    _check_what_it_names(cfg)
    takes_over = False
    if start is Start.NEW:
        takes_over = (run_dir / CONFIG_FILE).is_file() and never_committed(run_dir)
        if not takes_over:
            check_new_run_dir(run_dir)
    else:
        check_resumable(cfg, run_dir)  # never train on a store that fails `flexmarl store verify`
    return RunPlan(request, cfg, run_dir.resolve(), store_uri, start, takes_over)


def plan_config(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False) -> RunPlan:
    """The plan of a run whose config is given (benchmarks, tests): its locations and what it names are
    checked, and a new run in a directory that holds one is refused; nothing is taken over or verified (the
    caller made the directory)."""
    store_uri = check_run_location(cfg, run_dir)
    check_inputs(cfg)
    if not resume:
        check_new_run_dir(run_dir)
    request = RunRequest(str(run_dir), resume=resume)
    return RunPlan(request, cfg, Path(run_dir).resolve(), store_uri, Start.RESUMED if resume else Start.NEW)


def _start_of(request: RunRequest) -> Start:
    if request.resume:
        return Start.RESUMED
    # a retry of a flow run continues the run its earlier attempt started, never someone else's
    if request.retry_of is not None and any(by == request.retry_of for _, by in attempts(request.run_dir)):
        return Start.RETRIED
    return Start.NEW


def _config(request: RunRequest, start: Start) -> RunConfig:
    if start is Start.NEW:
        return load_config(request.config, preset=None if request.config else (request.preset or "default"),
                           overrides=list(request.overrides))
    try:
        return resume_config(request.run_dir, request.overrides)
    except ConfigError as exc:
        if start is Start.RESUMED and never_committed(request.run_dir):  # nothing to keep: start again instead
            raise ConfigError(f"{exc}. This run committed nothing, so start it again in place: `flexmarl train "
                              f"<config or --preset> --run-dir {request.run_dir}` with the fix") from None
        raise


def _check_what_it_names(cfg: RunConfig) -> None:
    check_inputs(cfg)
    check_tracking(cfg.tracking)
    if cfg.cluster.address:  # bounded by cluster.connect_timeout_s, also for a service that is not Dask
        connect(cfg.cluster.address, timeout_s=cfg.cluster.connect_timeout_s).close()


def check_new_run_dir(run_dir: str | Path) -> None:
    """Refuse to start a run in a directory that holds one: its sample ids would repeat the old run's."""
    if (Path(run_dir) / CONFIG_FILE).exists():
        raise RunDirError(
            f"{Path(run_dir).resolve()} already holds a run: continue it with `flexmarl train --resume {run_dir}`, "
            "or choose another --run-dir"
        )


def attempts(run_dir: str | Path) -> list[tuple[str, str | None]]:
    """Every start and resume of the run in ``run_dir``: (run id, who started it or None), oldest first."""
    path = Path(run_dir) / ATTEMPTS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [line.split("\t") for line in lines if line.strip()]
    return [(row[0], row[1] if len(row) > 1 else None) for row in rows]


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The config of the run in ``run_dir``, with overrides that change only what a resumed run may change
    (``RESUMABLE``); an override that repeats the run's own value is no change (a Prefect retry repeats them).

    Raises:
        ConfigError: no run in ``run_dir``, or an override of a setting its samples were made under.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} holds no run to resume (no {CONFIG_FILE}); pass the run directory of a run "
                          "that was started with `flexmarl train --run-dir`")
    stored, cfg = load_config(path), load_config(path, overrides=overrides)
    before, after = dotted_values(stored), dotted_values(cfg)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    refused = [k for k in changed if not any(fnmatchcase(k, r) for r in RESUMABLE)]
    if refused:
        allowed = ", ".join(RESUMABLE)
        raise ConfigError(
            f"cannot change {', '.join(refused)} when resuming: the samples in the store were made under the "
            f"run's own settings. A resumed run may change only {allowed}"
        )
    return cfg

