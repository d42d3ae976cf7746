"""`flexmarl bench chaos`: a tiny run under injected faults, checked for exactly-once training and exact weights.

Faults are real: a Dask worker process SIGKILLed while it runs a generation batch or a training micro-batch
(its nanny starts a new one under a new address), a worker SIGSTOPped while it generates (it stops
answering: the run must notice and replace it), and the driver process SIGKILLed mid-step and then resumed
from its store. With trainer groups (``training.max_slots`` > 1), also a rank that joined an agent's group,
SIGKILLed as it trains one of the step's micro-batches or as it enters the group's optimizer step. Which kinds
come when, and at which task or commit, is drawn from a seed. Each fault gets its own run against one
cluster; after every run the store must verify, every planned prompt must have been trained exactly once per
step, and the weights (staleness 0) must equal those of an uninterrupted run.

It drives the engine on Dask directly (no Prefect), like ``flexmarl bench pipeline``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from flexmarl.cluster.local import open_cluster
from flexmarl.config import RunConfig, load_config
from flexmarl.orchestrator.coverage import training_coverage
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.orchestrator.runtime import RunContext, Runtime
from flexmarl.reference import DRIFT_TOLERANCE, initial_weights, max_weight_diff, weight_drift
from flexmarl.run.plan import resume_config
from flexmarl.run.prepare import prepare_run
from flexmarl.run_start import max_staleness
from storage.store import ExperienceStore
from storage.verify import verify_store

KINDS = ("worker_kill_rollout", "worker_kill_train", "replica_hang", "driver_kill")
GROUP_KINDS = ("group_rank_kill_train", "group_rank_kill_finish")  # only where agents' trainers form groups
# Faults must be noticed in seconds on a tiny run: a short heartbeat and request timeout.
CHAOS_SETTINGS = ["run.steps=3", "cluster.heartbeat_timeout_s=5", "rollout.request_timeout_s=60"]


@dataclass
class WorkerFault:
    """Kill (SIGKILL) or freeze (SIGSTOP) the worker that runs the ``nth`` task of ``task_kind``, just after
    the pipeline submits it. Pass it as ``Runtime.run(on_submit=...)``; it fires once."""

    client: object
    task_kind: str  # "generate" or "train"
    nth: int
    sig: int = signal.SIGKILL
    delay_s: float = 0.05  # lets the task start on the worker first
    log_to: str | None = None  # a file that gets a line when the fault fires (from a driver process)
    seen: int = 0
    worker: str | None = None
    pid: int | None = None
    injected_at: float | None = None
    fired: threading.Event = field(default_factory=threading.Event)

    def __call__(self, kind: str, agent: str, worker: str) -> None:
        if kind != self.task_kind or self.worker is not None:
            return
        self.seen += 1
        if self.seen >= self.nth:
            self.worker = worker
            threading.Thread(target=self._inject, name="fault", daemon=True).start()

    def _inject(self) -> None:
        time.sleep(self.delay_s)
        try:
            self.pid = self.client.run(os.getpid, workers=[self.worker], callback_timeout=5)[self.worker]
            os.kill(self.pid, self.sig)
        except Exception:  # noqa: BLE001 - the worker is gone already (another fault): strike at the next task
            self.worker = None
            return
        self.injected_at = time.time()
        if self.log_to is not None:
            with open(self.log_to, "a") as f:
                f.write(f"{self.at}\n")
        self.fired.set()

    @property
    def at(self) -> str:
        return f"{self.task_kind} task #{self.seen} on {self.worker}"  # #nth, or later if that worker was gone


@dataclass
class RankFault(WorkerFault):
    """Kill the worker that joined an agent's trainer group (the run's first join), when the pipeline sends it
    that agent's first job of ``task_kind`` after the join: a micro-batch ("train": the step's gradient sum on
    that rank dies with it) or its part of the collective optimizer step ("finish": the other ranks'
    all-reduce fails)."""

    joined: tuple[str, str] | None = None  # (agent, worker) of the first join

    def __call__(self, kind: str, agent: str, worker: str) -> None:
        if kind == "join" and self.joined is None:
            self.joined = (agent, worker)
        elif (agent, worker) == self.joined and self.worker is None:
            super().__call__(kind, agent, worker)


def kill_at_commit(pid: int, store: ExperienceStore, agents: Sequence[str], commits: int, *, timeout_s: float,
                   also: Callable[[], bool] = lambda: True) -> float:
    """SIGKILL process ``pid`` once the agents' sample tables hold ``commits`` micro-batch commits in all (and
    ``also()`` holds).

    Returns when it was killed. Raises ``TimeoutError`` if the commits do not come within ``timeout_s``.
    """
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not _running(pid):
            raise RuntimeError(f"process {pid} ended before it was to be killed (at {commits} sample commits)")
        if sample_commits(store, agents) >= commits and also():
            os.kill(pid, signal.SIGKILL)
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"the driver did not reach {commits} sample commits within {timeout_s:.0f}s")


def sample_commits(store: ExperienceStore, agents: Sequence[str]) -> int:
    """How many micro-batch commits the agents' sample tables hold in all (0 before the tables exist)."""
    try:
        return sum(store.version(store.samples_table(a)) for a in agents)
    except Exception:  # noqa: BLE001 - the tables may not exist yet
        return 0


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def drive(cfg: RunConfig, run_dir: str, address: str, faults: Sequence[tuple[str, int]] = (),
          fired_log: str | None = None) -> None:
    """A driver process: start a run and train it to the end (the chaos bench kills it mid-step).

    ``faults`` arms one ``WorkerFault`` (SIGKILL) per (task kind, nth); each that fires writes a line to
    ``fired_log``.
    """
    run_id, store_uri = prepare_run(cfg, run_dir)
    runtime = Runtime(RunContext(run_id, str(Path(run_dir).resolve()), store_uri, address), cfg)
    armed = [WorkerFault(runtime.client, kind, nth, log_to=fired_log) for kind, nth in faults]
    try:
        runtime.start_engines()
        runtime.run(on_submit=all_of(armed) if armed else None)
    finally:
        runtime.close()


def all_of(faults: Sequence[WorkerFault]) -> Callable[[str, str, str], None]:
    """One ``on_submit`` that arms several faults in one run: each fires once, counting its own task kind, on a
    worker no other of them struck (two faults on one dying worker would be one)."""
    def on_submit(kind: str, agent: str, worker: str) -> None:
        struck = {f.worker for f in faults}
        for fault in faults:
            if fault.worker is None and worker not in struck:
                fault(kind, agent, worker)
    return on_submit


def train(
    cfg: RunConfig, run_dir: Path, address: str, *, resume: bool = False,
    on_submit: Callable[[str, str, str], None] | None = None, on_started: Callable[[], None] | None = None,
) -> tuple[PipelineResult, dict[str, dict[str, torch.Tensor]]]:
    """Run (or resume) a run in this process; returns the pipeline's result and every agent's final weights."""
    run_id, store_uri = prepare_run(cfg, run_dir, resume=resume)
    runtime = Runtime(RunContext(run_id, str(run_dir.resolve()), store_uri, address), cfg)
    try:
        runtime.start_engines()
        if on_started is not None:
            on_started()
        result = runtime.run(on_submit=on_submit)
        return result, {agent: runtime.weights(agent) for agent in cfg.agents}
    finally:
        runtime.close()


def schedule(n: int, seed: int, kinds: Sequence[str] = KINDS) -> list[str]:
    """``n`` fault kinds: every kind once per round, each round in a seeded order."""
    rng = random.Random(seed)
    drawn: list[str] = []
    while len(drawn) < n:
        drawn += rng.sample(list(kinds), len(kinds))
    return drawn[:n]


def bench_chaos(
    *, out_dir: Path, preset: str = "tiny", faults: int = 6, seed: int = 0, overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict:
    """Run ``faults`` faulted runs (and one uninterrupted reference) and write ``out_dir/chaos.json``."""
    if faults < 1:
        raise ValueError(f"faults must be >= 1, got {faults}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(preset=preset, overrides=[*CHAOS_SETTINGS, *overrides])
    rng = random.Random(seed)
    runs: list[dict] = []
    with open_cluster(cfg.cluster) as address:
        shutil.rmtree(out_dir / "reference", ignore_errors=True)
        log("reference: an uninterrupted run")
        reference, ref_weights = train(cfg, out_dir / "reference", address)
        start_weights = initial_weights(cfg)
        # how many tasks of each kind a run submits, so that a fault's point falls inside the run
        tasks = {"generate": sum(s.kind == "rollout" for s in reference.spans),
                 "train": sum(s.kind == "train" for s in reference.spans) - cfg.run.steps * len(cfg.agents)}
        commits = sum(ExperienceStore(out_dir / "reference" / "store").version(f"samples/{a}") for a in cfg.agents)
        grouped = any(cfg.trainer_config(a).max_slots > 1 for a in cfg.agents)
        for i, kind in enumerate(schedule(faults, seed, KINDS + GROUP_KINDS if grouped else KINDS)):
            run_dir = out_dir / f"run{i}-{kind}"
            shutil.rmtree(run_dir, ignore_errors=True)
            log(f"run {i}: {kind}")
            t0 = time.time()
            if kind == "driver_kill":
                record, weights = _driver_kill(cfg, run_dir, address, rng.randint(2, max(2, commits - 2)))
            elif kind in GROUP_KINDS:
                record, weights = _worker_fault(cfg, run_dir, address, RankFault(None, kind.rsplit("_", 1)[1], 1))
            else:
                task_kind = "train" if kind == "worker_kill_train" else "generate"
                nth = rng.randint(1, max(1, tasks[task_kind] * 4 // 5))
                sig = signal.SIGSTOP if kind == "replica_hang" else signal.SIGKILL
                fault = WorkerFault(None, task_kind, nth, sig)
                record, weights = _worker_fault(cfg, run_dir, address, fault)
            store = ExperienceStore(run_dir / "store")
            coverage = training_coverage(store, cfg)
            violations = verify_store(store, max_staleness=max_staleness(cfg))
            diff, drift = max_weight_diff(ref_weights, weights), weight_drift(ref_weights, weights, start_weights)
            runs.append({
                "kind": kind, **record, "wall_s": time.time() - t0, "verify_violations": len(violations),
                "samples_lost": coverage.samples_lost, "samples_duplicated": coverage.samples_duplicated,
                "samples_unplanned": coverage.samples_unplanned, "prompts_skipped": coverage.prompts_skipped,
                "steps_checked": coverage.steps, "max_weight_diff": diff, "weight_drift": drift,
            })
            log(f"run {i}: {kind} at {record['at']}: recovered in {record['recovered_s']}s, verify "
                f"{len(violations)} violations, {coverage}, max weight diff {diff:.2e}, drift {drift:.1e} of the move")
    report = {
        "faults_injected": sum(1 for r in runs if r["injected"]),
        "runs_completed": sum(1 for r in runs if r["completed"]),
        "samples_lost": sum(r["samples_lost"] for r in runs),
        "samples_duplicated": sum(r["samples_duplicated"] + r["samples_unplanned"] for r in runs),
        "prompts_skipped": sum(r["prompts_skipped"] for r in runs),
        "weights_match_uninterrupted": all(r["weight_drift"] <= DRIFT_TOLERANCE for r in runs),
        "stores_verified": all(r["verify_violations"] == 0 for r in runs),
        "faults": [{"kind": r["kind"], "at": r["at"], "recovered_s": r["recovered_s"]} for r in runs],
        "runs": runs,
        "preset": preset,
        "seed": seed,
        "reference_wall_s": reference.wall_s,
    }
    (out_dir / "chaos.json").write_text(json.dumps(report, indent=2))
    return report


def _worker_fault(cfg: RunConfig, run_dir: Path, address: str, fault: WorkerFault) -> tuple[dict, dict]:
    from flexmarl.cluster.local import connect

    with connect(address, timeout_s=cfg.cluster.connect_timeout_s) as client:
        fault.client = client
        result, weights = train(cfg, run_dir, address, on_submit=fault)
        fault.fired.wait(timeout=5)
    recovered = [r for r in result.recoveries if r.recovered_at is not None and fault.worker in r.workers]
    recovered_s = round(recovered[0].recovered_at - fault.injected_at, 3) if recovered and fault.injected_at else None
    record = {"at": fault.at, "injected": fault.injected_at is not None, "completed": True,
              "recovered_s": recovered_s, "recoveries": len(result.recoveries)}
    return record, weights


def kill_driver(cfg: RunConfig, run_dir: Path, address: str, commits: int, *,
                faults: Sequence[tuple[str, int]] = (), fired_log: Path | None = None,
                also: Callable[[], bool] = lambda: True) -> float:
    """Start a run in a driver process (with ``faults`` armed, see ``drive``) and SIGKILL it after ``commits``
    sample commits, once every fault fired and ``also()`` holds; returns when."""
    def ready() -> bool:
        fired = not faults or (fired_log.exists() and len(fired_log.read_text().splitlines()) >= len(faults))
        return fired and also()

    args = (cfg, str(run_dir), address, tuple(faults), None if fired_log is None else str(fired_log))
    driver = multiprocessing.get_context("spawn").Process(target=drive, args=args)
    driver.start()
    store = ExperienceStore(run_dir / "store")
    try:
        return kill_at_commit(driver.pid, store, list(cfg.agents), commits, timeout_s=600, also=ready)
    finally:
        driver.join(timeout=30)
        if driver.is_alive():
            driver.kill()


def _driver_kill(cfg: RunConfig, run_dir: Path, address: str, commits: int) -> tuple[dict, dict]:
    """Start a driver process, SIGKILL it after ``commits`` sample commits, resume the run in this process."""
    killed_at = kill_driver(cfg, run_dir, address, commits)
    started: list[float] = []
    result, weights = train(resume_config(run_dir), run_dir, address, resume=True,
                            on_started=lambda: started.append(time.time()))
    record = {"at": f"after sample commit {commits}", "injected": True, "completed": True,
              "recovered_s": round(started[0] - killed_at, 3), "samples_reused": result.samples_reused}
    return record, weights
