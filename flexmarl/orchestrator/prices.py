"""What the scheduler has seen training jobs cost: per agent, the median seconds of its recent jobs of each kind.

The executors report each finished job's seconds on its worker (``Scheduler.done``: the Dask runtime's task
times, the simulator's priced durations). The growth rule reads them (``SchedulePolicy.grows``, through
``GrowthPrice``); a cost not yet seen has no price, and the rule then counts micro-batches as it did before
any was seen.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from flexmarl.orchestrator.commands import Finish, Job, Join, MoveState, Park, Train

WINDOW = 8  # the most recent jobs of a kind that set its price: a run's pace drifts (noisy machine, longer answers)


class JobPrices:
    """Recent seconds per (agent, what): ``train`` (one micro-batch on one rank), ``park``, ``resume`` (a join's or
    an unprefetched move's read and load), ``step`` (a one-rank optimizer step) and ``reduce`` (what a group's
    all-reduce adds to its step, per unit of a ring's traffic: 2 (k - 1) / k of the gradient)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], deque[float]] = {}

    def observe(self, job: Job, seconds: float) -> None:
        if isinstance(job, Train):
            self._add(job.agent, "train", seconds)
        elif isinstance(job, Park):
            self._add(job.agent, "park", seconds)
        elif isinstance(job, Join) or (isinstance(job, MoveState) and not job.prefetched):
            self._add(job.agent, "resume", seconds)
        elif isinstance(job, Finish) and not job.members:
            self._add(job.agent, "step", seconds)
        elif isinstance(job, Finish) and (alone := self.of(job.agent, "step")) is not None:
            k = len(job.members)
            self._add(job.agent, "reduce", max(seconds - alone, 0.0) / ring_share(k))

    def of(self, agent: str, what: str) -> float | None:
        """The median of the agent's last ``WINDOW`` jobs of ``what``, or None if none was seen."""
        seen = self._seen.get((agent, what))
        return median(seen) if seen else None

    def move_s(self, agent: str) -> float | None:
        """A park and a resume of the agent's state: what moving it to another slot costs."""
        park, resume = self.of(agent, "park"), self.of(agent, "resume")
        return None if park is None or resume is None else park + resume

    def reduce_s(self, agent: str, ranks: int) -> float:
        """What growing the agent's group from ``ranks`` to ``ranks + 1`` adds to its optimizer step (0 until a
        group step was seen)."""
        unit = self.of(agent, "reduce") or 0.0
        return unit * (ring_share(ranks + 1) - ring_share(ranks))

    def _add(self, agent: str, what: str, seconds: float) -> None:
        self._seen.setdefault((agent, what), deque(maxlen=WINDOW)).append(seconds)


def ring_share(ranks: int) -> float:
    """The share of the gradient each rank of a ring all-reduce over ``ranks`` sends (and receives); none for one
    rank (or none named: a one-rank step)."""
    return 2 * (ranks - 1) / ranks if ranks > 1 else 0.0
