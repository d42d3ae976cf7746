"""The scheduler's vocabulary: one frozen record per kind of work, and one table of what each kind is.

``Scheduler`` (``scheduler.py``) returns these as commands; an executor (the Dask runtime in ``pipeline.py``,
the simulated clock in ``flexmarl/sim``) carries them out and reports back. Worker tasks run on ``worker``
and are kept in the scheduler's ``InFlight`` ledger until they finish or are given up; driver commands are
done by the executor at once (scoring, store commits) and are not tracked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from flexmarl.rollout.balancer import Replica


class TaskKind(Enum):
    """(name, priority on its worker, timeline span kind). A worker runs one task at a time, the highest
    priority first: generation gates the episodes (and so every agent's next batch), so it goes first; weight
    syncs and parks next; training, swaps and optimizer steps fill the gaps. A prefetch only starts a
    background read, so it goes before everything."""

    GENERATE = ("generate", 10, "rollout")
    TRAIN = ("train", 0, "train")
    FINISH = ("finish", 0, "train")
    SYNC = ("sync", 5, "sync")
    PARK = ("park", 5, "swap")
    RESUME = ("move", 0, "swap")
    PREFETCH = ("prefetch", 20, "swap")
    SNAPSHOT = ("snapshot", 0, "snapshot")
    RESTORE = ("restore", 0, "swap")
    START_REPLICA = ("replica", 0, "sync")
    CATCH_UP = ("catchup", 0, "sync")

    def __init__(self, label: str, priority: int, span: str) -> None:
        self.label, self.priority, self.span = label, priority, span


# Tasks that run where the agent's trainer lives (a lost worker took them, and the trainer, with it).
ON_TRAINER = frozenset({TaskKind.TRAIN, TaskKind.FINISH, TaskKind.PARK, TaskKind.SNAPSHOT})
# The agent trains nothing until these are done.
BLOCKING = frozenset({TaskKind.FINISH, TaskKind.SNAPSHOT, TaskKind.RESUME, TaskKind.RESTORE})


@dataclass(frozen=True)
class Request:
    """One node of one episode to generate: ``episode`` indexes the step's episodes (query-major)."""

    step: int
    sample_id: str
    episode: int
    node: str


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
    data: object = None  # what the executor's trainer reads (the runtime: Delta version and sample ids)
    trainable: bool = True  # it has samples to learn from (a resumed run's consumed ones have none left)
    submitted: bool = False  # sent to the trainer
    trained: bool = False


# ---------------------------------------------------------------- worker tasks (tracked in flight)

@dataclass(frozen=True, eq=False)
class Task:
    kind: ClassVar[TaskKind]
    agent: str
    worker: str  # where it runs


@dataclass(frozen=True, eq=False)
class Generate(Task):
    kind: ClassVar[TaskKind] = TaskKind.GENERATE
    replica: Replica
    requests: tuple[Request, ...]
    tokens: int  # the most it can generate (for intra-agent balancing)


@dataclass(frozen=True, eq=False)
class Train(Task):
    kind: ClassVar[TaskKind] = TaskKind.TRAIN
    batch: MicroBatch


@dataclass(frozen=True, eq=False)
class Finish(Task):
    """The optimizer step that ends ``step``'s update."""

    kind: ClassVar[TaskKind] = TaskKind.FINISH
    step: int


@dataclass(frozen=True, eq=False)
class Snapshot(Task):
    """Write the agent's training state after ``step``'s update, before the update is recorded; in the
    background (the task returns once the state is copied to host memory) unless it is the run's last."""

    kind: ClassVar[TaskKind] = TaskKind.SNAPSHOT
    step: int
    background: bool = False


@dataclass(frozen=True, eq=False)
class Sync(Task):
    """Load ``version`` into the agent's engine on ``worker``: from the trainer (``source``), or, when the
    trainer that made it is gone, from the agent's snapshot of it (``source`` None)."""

    kind: ClassVar[TaskKind] = TaskKind.SYNC
    version: int
    source: str | None


@dataclass(frozen=True, eq=False)
class Park(Task):
    """Write the agent's state from ``worker`` (its trainer) to the state store, so another slot can resume it."""

    kind: ClassVar[TaskKind] = TaskKind.PARK


@dataclass(frozen=True, eq=False)
class Resume(Task):
    """Resume the agent's parked state on ``worker`` (a move from ``source``); ``prefetched``: the slot read it
    ahead into host memory."""

    kind: ClassVar[TaskKind] = TaskKind.RESUME
    source: str
    prefetched: bool


@dataclass(frozen=True, eq=False)
class Restore(Task):
    """Rebuild a lost trainer on ``worker`` from the agent's snapshot of ``version``."""

    kind: ClassVar[TaskKind] = TaskKind.RESTORE
    version: int


@dataclass(frozen=True, eq=False)
class StartReplica(Task):
    """Start the agent's rollout engine on a new ``worker`` from its snapshot of ``version``."""

    kind: ClassVar[TaskKind] = TaskKind.START_REPLICA
    version: int


@dataclass(frozen=True, eq=False)
class CatchUp(Task):
    """An engine started at an older version loads ``version`` from its snapshot."""

    kind: ClassVar[TaskKind] = TaskKind.CATCH_UP
    version: int


# ---------------------------------------------------------------- commands not tracked in flight

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
    """Give up a task in flight (its worker was lost, or the trainer it served was)."""

    task: Task


class InFlight:
    """The one ledger of worker tasks submitted and not yet finished or given up."""

    def __init__(self) -> None:
        self._tasks: dict[int, Task] = {}
        self._holding: Counter[str] = Counter()  # per worker: tasks other than generation on its task thread

    def add(self, task: Task) -> Task:
        self._tasks[id(task)] = task
        if _holds_thread(task):
            self._holding[task.worker] += 1
        return task

    def pop(self, task: Task) -> bool:
        """Stop tracking ``task``; False if it was not tracked (given up meanwhile)."""
        if self._tasks.pop(id(task), None) is None:
            return False
        if _holds_thread(task):
            self._holding[task.worker] -= 1
        return True

    def holding(self, worker: str) -> int:
        """Tasks other than generation that ``worker`` runs or has queued (training, optimizer steps, syncs,
        moves): a generation batch sent there waits for the running one."""
        return self._holding[worker]

    def __contains__(self, task: Task) -> bool:
        return id(task) in self._tasks

    def __iter__(self) -> Iterator[Task]:
        return iter(list(self._tasks.values()))

    def __len__(self) -> int:
        return len(self._tasks)

    def of(self, agent: str | None = None, *kinds: TaskKind, worker: str | None = None) -> list[Task]:
        return [t for t in self._tasks.values() if (agent is None or t.agent == agent)
                and (not kinds or t.kind in kinds) and (worker is None or t.worker == worker)]


def _holds_thread(task: Task) -> bool:
    """Does ``task`` occupy its worker's task thread? Generation batches are counted apart (outstanding tokens);
    a background snapshot returns once its state is in host memory."""
    return task.kind is not TaskKind.GENERATE and not (isinstance(task, Snapshot) and task.background)


def overdue(task: Task, sync_timeout_s: float, request_timeout_s: float) -> str:
    """Why ``task``, past its deadline, fails the run where its worker cannot be replaced."""
    if isinstance(task, Sync):
        return (f"weight sync of agent {task.agent!r} to v{task.version} on replica {task.worker} did not finish "
                f"within {sync_timeout_s:.0f}s (rollout.sync_timeout_s)")
    what = (f"generation batch of agent {task.agent!r} on replica" if isinstance(task, Generate)
            else f"{task.kind.label} task of agent {task.agent!r} on worker")
    return f"{what} {task.worker} did not finish within {request_timeout_s:.0f}s (rollout.request_timeout_s)"
