"""What a simulated run produced, and the schedules it can simulate (no scheduling logic here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flexmarl.rollout.balancer import Move


@dataclass(frozen=True)
class SimMode:
    """A schedule to simulate: the same settings ``flexmarl bench pipeline`` overrides for its modes."""

    mode: str  # run.mode: "sync" or "flexmarl"
    pipeline: bool = True  # run.pipeline
    max_staleness: int = 0  # run.max_staleness
    load_balance: bool = True  # rollout.load_balance
    micro_batch_generation: bool | None = None  # rollout.micro_batch_generation; None: the preset's
    baseline_layout: bool = False  # run on the preset's sync_layout (the MARTI-like colocated cluster)
    max_slots: int = 1  # training.max_slots: the most training slots each agent's trainer group may span


# All but sync-disagg are flexmarl/bench/pipeline_bench.py's MODES (a test checks they agree).
MODES: dict[str, SimMode] = {
    "sync": SimMode("sync", load_balance=False, baseline_layout=True),
    "flexmarl": SimMode("flexmarl"),
    "no-lb": SimMode("flexmarl", load_balance=False),
    "no-pipeline": SimMode("flexmarl", pipeline=False),
    "stale1": SimMode("flexmarl", max_staleness=1),
    "whole-batches": SimMode("flexmarl", micro_batch_generation=False),
    # trainer groups (data parallel over up to two slots) in flexmarl, and in the sync baseline on its layout
    "flexmarl-group": SimMode("flexmarl", max_slots=2),
    "sync-group": SimMode("sync", load_balance=False, baseline_layout=True, max_slots=2),
    # Beyond the benchmark's modes: the sync schedule (layered rollout, barrier, train all) on the flexmarl
    # layout, the nearest to the paper's "without the pipeline" ablation, whose training waits for the step.
    "sync-disagg": SimMode("sync"),
}

SPAN_KINDS = ("rollout", "train", "swap", "sync", "snapshot")


@dataclass
class Worker:
    """A device group that runs its tasks highest priority first, ``lanes`` at a time (a Dask worker: one).

    A rollout worker of a continuous-batching engine has one lane per replica: the engine decodes the
    slots' batches together, so a slot's next batch does not wait for another slot's long tail.
    """

    name: str
    devices: int
    role: str  # "rollout", "train" or "both" (colocated)
    lanes: int = 1
    queue: list = field(default_factory=list)  # heap of (-priority, seq, engine.Running)
    running: list = field(default_factory=list)  # the jobs it runs now (engine.Running)
    resident: str | None = None  # the agent whose training state is on the devices


@dataclass(frozen=True)
class UpdateRecord:
    agent: str
    step: int
    finished_at: float
    samples: int
    tokens: int


@dataclass
class SimResult:
    """What a simulated run produced: the clock, every task's span, every update."""

    mode: str
    wall_s: float
    steps: int
    workers: list[Worker]
    span_worker: np.ndarray  # per span: index into workers
    span_kind: np.ndarray  # index into SPAN_KINDS
    span_agent: np.ndarray  # index into agents
    span_start: np.ndarray
    span_end: np.ndarray
    agents: list[str]
    updates: list[UpdateRecord]
    tokens: int  # response tokens generated
    moves: list[Move]
    events: int

    @property
    def devices(self) -> int:
        return sum(w.devices for w in self.workers)

    def busy_s(self) -> np.ndarray:
        """Per worker, the seconds it was busy (the union of its spans: continuous-batching lanes overlap)."""
        busy = np.zeros(len(self.workers))
        order = np.lexsort((self.span_start, self.span_worker))
        worker, start, end = self.span_worker[order], self.span_start[order], self.span_end[order]
        current, lo, hi = -1, 0.0, 0.0
        for w, s, e in zip(worker.tolist(), start.tolist(), end.tolist()):
            if w != current or s > hi:
                if current >= 0:
                    busy[current] += hi - lo
                current, lo, hi = w, s, e
            else:
                hi = max(hi, e)
        if current >= 0:
            busy[current] += hi - lo
        return busy

    def utilization(self) -> float:
        """Busy device-seconds over all device-seconds of the layout."""
        devices = np.array([w.devices for w in self.workers], dtype=float)
        return float(self.busy_s() @ devices) / (self.devices * self.wall_s) if self.wall_s > 0 else 0.0

    def step_ends(self) -> list[float]:
        """When each step's last agent update finished."""
        ends: dict[int, float] = {}
        for u in self.updates:
            ends[u.step] = max(ends.get(u.step, 0.0), u.finished_at)
        return [ends[s] for s in sorted(ends)]

    def step_s(self) -> float:
        """Seconds per step in steady state: between the first step's end and the last's (the first step also
        fills the pipeline); with one step, its time."""
        ends = self.step_ends()
        return ends[0] if len(ends) == 1 else (ends[-1] - ends[0]) / (len(ends) - 1)
