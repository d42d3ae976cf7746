"""The scheduler's vocabulary: one frozen record per command, and one table of what each kind of job is.

``Scheduler`` (``scheduler.py``) returns these; an executor (the Dask runtime in ``pipeline.py``, the simulated
clock in ``flexmarl/sim``) carries them out and reports back. A *job* is a command that runs on a worker
(``Job.worker``): it is kept in the scheduler's ``InFlight`` ledger until it finishes or is given up. The other
commands are done by the executor at once (scoring, store commits) and are not tracked. ("Task" is Prefect's
word in this project, and a dataset's item is a problem.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from flexmarl.rollout.balancer import Replica


class JobKind(Enum):
    """(name, priority on its worker, timeline span kind). A worker runs one job at a time, the highest
    priority first: generation gates the episodes (and so every agent's next batch), so it goes first; weight
    syncs and parks next; training, swaps and optimizer steps fill the gaps. A prefetch only starts a
    background read, so it goes before everything."""

    GENERATE = ("generate", 10, "rollout")
    TRAIN = ("train", 0, "train")
    FINISH = ("finish", 0, "train")
    SYNC = ("sync", 5, "sync")
    PARK = ("park", 5, "swap")
    MOVE_STATE = ("move", 0, "swap")
    JOIN = ("join", 0, "swap")
    PREFETCH = ("prefetch", 20, "swap")
    SNAPSHOT = ("snapshot", 0, "snapshot")
    RESTORE = ("restore", 0, "swap")
    START_REPLICA = ("replica", 0, "sync")
    CATCH_UP = ("catchup", 0, "sync")

    def __init__(self, label: str, priority: int, span: str) -> None:
        self.label, self.priority, self.span = label, priority, span


# Jobs that run where the agent's trainer lives (a lost worker took them, and the trainer, with it).
ON_TRAINER = frozenset({JobKind.TRAIN, JobKind.FINISH, JobKind.PARK, JobKind.SNAPSHOT})
# The agent trains nothing until these are done (a joining rank only holds back its optimizer step).
BLOCKING = frozenset({JobKind.FINISH, JobKind.SNAPSHOT, JobKind.MOVE_STATE, JobKind.RESTORE})


@dataclass(frozen=True)
class Request:
    """One node of one episode to generate: ``episode`` indexes the step's episodes (query-major)."""

    step: int
    sample_id: str
    episode: int
    node: str


@dataclass(frozen=True)
class StoredBatch:
    """Where a committed micro-batch's trainer reads it: the agent's sample table at ``version``, these rows."""

    version: int
    sample_ids: tuple[str, ...]


@dataclass(eq=False)
class MicroBatch:
    """Whole GRPO groups of consecutive queries of one agent's step: what one trainer call consumes."""

    agent: str
    step: int
    index: int
    queries: set[int]
    done_queries: set[int] = field(default_factory=set)
    committed: bool = False
    committed_at: float = 0.0
    stored: StoredBatch | None = None  # set by the runtime's commit (the simulator reads nothing)
    trainable: bool = True  # it has samples to learn from (a resumed run's consumed ones have none left)
    submitted: bool = False  # sent to the trainer
    trained: bool = False


# ---------------------------------------------------------------- jobs (run on a worker, tracked in flight)

@dataclass(frozen=True, eq=False)
class Job:
    kind: ClassVar[JobKind]
    agent: str
    worker: str  # where it runs


@dataclass(frozen=True, eq=False)
class Generate(Job):
    kind: ClassVar[JobKind] = JobKind.GENERATE
    replica: Replica
    requests: tuple[Request, ...]
    tokens: int  # the most it can generate (for intra-agent balancing)


@dataclass(frozen=True, eq=False)
class Train(Job):
    kind: ClassVar[JobKind] = JobKind.TRAIN
    batch: MicroBatch


@dataclass(frozen=True, eq=False)
class Finish(Job):
    """The optimizer step that ends ``step``'s update. With ``members`` (the ranks of the agent's trainer group,
    its home first), one of the group's collective steps: one such job per member, all of formation
    ``formation``, which stays while the members do."""

    kind: ClassVar[JobKind] = JobKind.FINISH
    step: int
    members: tuple[str, ...] = ()
    formation: int = 0


@dataclass(frozen=True, eq=False)
class Snapshot(Job):
    """Write the agent's training state after ``step``'s update, before the update is recorded; in the
    background (the job returns once the state is copied to host memory) unless it is the run's last."""

    kind: ClassVar[JobKind] = JobKind.SNAPSHOT
    step: int
    background: bool = False


@dataclass(frozen=True, eq=False)
class Sync(Job):
    """Load ``version`` into the agent's engine on ``worker``: from the trainer (``source``), or, when the
    trainer that made it is gone, from the agent's snapshot of it (``source`` None)."""

    kind: ClassVar[JobKind] = JobKind.SYNC
    version: int
    source: str | None

    @property
    def in_place(self) -> bool:
        """The trainer is on the engine's own worker: the engine copies its tensors where they are."""
        return self.source == self.worker


@dataclass(frozen=True, eq=False)
class Park(Job):
    """Write the agent's state from ``worker`` (its trainer) to the state store, so another slot can resume it."""

    kind: ClassVar[JobKind] = JobKind.PARK


@dataclass(frozen=True, eq=False)
class MoveState(Job):
    """Move the agent's training state to ``worker`` from ``source``: resume there what ``source`` parked;
    ``prefetched``: the slot read it ahead into host memory."""

    kind: ClassVar[JobKind] = JobKind.MOVE_STATE
    source: str
    prefetched: bool


@dataclass(frozen=True, eq=False)
class Join(Job):
    """``worker`` joins the agent's trainer group for its current step: it resumes what the agent's home
    (``source``) parked, and the home keeps its trainer (and the step's gradient sum)."""

    kind: ClassVar[JobKind] = JobKind.JOIN
    source: str


@dataclass(frozen=True, eq=False)
class Restore(Job):
    """Rebuild a lost trainer on ``worker`` from the agent's snapshot of ``version``. A sharded agent's is one
    such job per rank of ``members`` (its new ranks, home first), which form their world as formation
    ``formation``."""

    kind: ClassVar[JobKind] = JobKind.RESTORE
    version: int
    members: tuple[str, ...] = ()
    formation: int = 0


@dataclass(frozen=True, eq=False)
class StartReplica(Job):
    """Start the agent's rollout engine on a new ``worker`` from its snapshot of ``version``."""

    kind: ClassVar[JobKind] = JobKind.START_REPLICA
    version: int


@dataclass(frozen=True, eq=False)
class CatchUp(Job):
    """An engine started at an older version loads ``version`` from its snapshot."""

    kind: ClassVar[JobKind] = JobKind.CATCH_UP
    version: int


# ---------------------------------------------------------------- commands the executor does at once

@dataclass(frozen=True, eq=False)
class Prefetch:
    """Start reading the agent's parked state into ``worker``'s host memory (a background read)."""

    agent: str
    worker: str


@dataclass(frozen=True, eq=False)
class Discard:
    """Free what ``worker`` holds of the agent that is no longer needed: a prefetched copy (``trainer`` False)
    or the trainer a move left behind (``trainer`` True)."""

    agent: str
    worker: str
    trainer: bool = False


@dataclass(frozen=True, eq=False)
class Replay:
    """A request whose result a crashed run already committed: record it from the store, do not generate it."""

    request: Request


@dataclass(frozen=True, eq=False)
class GroupDone:
    """Every episode of the step's query is done: the executor scores the group."""

    step: int
    query: int


@dataclass(frozen=True, eq=False)
class Commit:
    """Commit these micro-batches of the agent to the store; ``whole_batch``: agent-wise advantages, so the
    agent's whole batch is normalised together first."""

    agent: str
    step: int
    batches: tuple[MicroBatch, ...]
    whole_batch: bool


@dataclass(frozen=True, eq=False)
class StepDone:
    """Every sample of the step is committed: the executor writes its episodes and lets its data go."""

    step: int


@dataclass(frozen=True, eq=False)
class RecordUpdate:
    """Record the agent's update of ``step`` in the store; the executor then calls ``Scheduler.updated``."""

    agent: str
    step: int


@dataclass(frozen=True, eq=False)
class Cancel:
    """Give up a job in flight (its worker was lost, or the trainer it served was)."""

    job: Job


class InFlight:
    """The one ledger of jobs submitted and not yet finished or given up."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._holding: Counter[str] = Counter()  # per worker: jobs other than generation on its task thread

    def add(self, job: Job) -> Job:
        self._jobs[id(job)] = job
        if _holds_thread(job):
            self._holding[job.worker] += 1
        return job

    def pop(self, job: Job) -> bool:
        """Stop tracking ``job``; False if it was not tracked (given up meanwhile)."""
        if self._jobs.pop(id(job), None) is None:
            return False
        if _holds_thread(job):
            self._holding[job.worker] -= 1
        return True

    def holding(self, worker: str) -> int:
        """Jobs other than generation that ``worker`` runs or has queued (training, optimizer steps, syncs,
        moves): a generation batch sent there waits for the running one."""
        return self._holding[worker]

    def __contains__(self, job: Job) -> bool:
        return id(job) in self._jobs

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def __len__(self) -> int:
        return len(self._jobs)

    def of(self, agent: str | None = None, *kinds: JobKind, worker: str | None = None) -> list[Job]:
        return [j for j in self._jobs.values() if (agent is None or j.agent == agent)
                and (not kinds or j.kind in kinds) and (worker is None or j.worker == worker)]


def _holds_thread(job: Job) -> bool:
    """Does ``job`` occupy its worker's task thread? Generation batches are counted apart (outstanding tokens);
    a background snapshot returns once its state is in host memory."""
    return job.kind is not JobKind.GENERATE and not (isinstance(job, Snapshot) and job.background)


def overdue(job: Job, sync_timeout_s: float, request_timeout_s: float) -> str:
    """Why ``job``, past its deadline, fails the run where its worker cannot be replaced."""
    if isinstance(job, Sync):
        return (f"weight sync of agent {job.agent!r} to v{job.version} on replica {job.worker} did not finish "
                f"within {sync_timeout_s:.0f}s (rollout.sync_timeout_s)")
    what = (f"generation batch of agent {job.agent!r} on replica" if isinstance(job, Generate)
            else f"{job.kind.label} task of agent {job.agent!r} on worker")
    return f"{what} {job.worker} did not finish within {request_timeout_s:.0f}s (rollout.request_timeout_s)"
