"""Each agent update as a Prefect task run, ``update-<agent>-v<version>`` tagged ``agent:<agent>``.

The run starts when its step is admitted and ends Completed once the update is recorded and every replica of
the agent holds its weights, Failed with the agent's error when a task of that agent fails the run, Cancelled
when the run stops first; Prefect's run graph draws the agents' updates side by side, overlapping when the
pipeline runs them at once. ``UpdateLedger`` decides, from the pipeline's records and nothing else, when each
update starts and how it ends; ``agent_update`` is the task run, which waits on an in-process future that the
pipeline task's view (``run_view.py``) settles as the ledger says.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.states import Cancelled, State

from flexmarl.orchestrator.records import AgentFailed, PipelineEvent, StepOpened, UpdateEvent, WeightSynced


class AgentUpdateError(RuntimeError):
    """An agent's update failed: the error of the agent's task that failed the run."""


class UpdateNotMade(Exception):
    """The run ended before this update was made (stopped, or failed on another agent)."""


@dataclass(frozen=True)
class UpdateKey:
    agent: str
    version: int


@dataclass(frozen=True)
class Settled:
    """How an update ended: made (its ``UpdateEvent``), failed with its agent, or not made."""

    key: UpdateKey
    outcome: UpdateEvent | AgentUpdateError | UpdateNotMade


@dataclass(frozen=True)
class Ledgered:
    """What one pipeline record changes: updates to start, updates settled, and the update it recorded."""

    started: tuple[UpdateKey, ...] = ()
    settled: tuple[Settled, ...] = ()
    recorded: UpdateEvent | None = None


@dataclass
class UpdateLedger:
    """The updates of a run that have started and not ended: pure, fed the pipeline's records in order."""

    waiting: list[UpdateKey] = field(default_factory=list)  # started, not settled
    recorded: dict[UpdateKey, UpdateEvent] = field(default_factory=dict)  # recorded, replicas not all synced

    def on(self, event: PipelineEvent) -> Ledgered:
        if isinstance(event, StepOpened):  # each agent on it makes version step + 1
            started = tuple(UpdateKey(agent, event.step + 1) for agent in event.agents)
            self.waiting += started
            return Ledgered(started=started)
        if isinstance(event, UpdateEvent):
            self.recorded[UpdateKey(event.agent, event.policy_version)] = event
            return Ledgered(recorded=event)
        if isinstance(event, WeightSynced) and event.all_synced:
            keys = [k for k in self.recorded if k.agent == event.agent and k.version <= event.version]
            return Ledgered(settled=tuple(self._settle(k, self.recorded.pop(k)) for k in keys))
        if isinstance(event, AgentFailed):
            keys = [k for k in self.waiting if k.agent == event.agent]
            for key in keys:
                self.recorded.pop(key, None)
            return Ledgered(settled=tuple(self._settle(k, AgentUpdateError(event.error)) for k in keys))
        return Ledgered()

    def close(self, why: str | None) -> tuple[Settled, ...]:
        """The pipeline ended (``why``: None when it finished): settle every update still waiting. A recorded
        one is made, whatever the last sync did: the run has it."""
        made = [self._settle(k, u) for k, u in self.recorded.items()]
        self.recorded.clear()
        why = f"the run ended before this update: {why or 'not admitted'}"
        return (*made, *(self._settle(k, UpdateNotMade(why)) for k in list(self.waiting)))

    def _settle(self, key: UpdateKey, outcome: UpdateEvent | AgentUpdateError | UpdateNotMade) -> Settled:
        self.waiting.remove(key)
        return Settled(key, outcome)


@task(name="agent-update", cache_policy=NO_CACHE, task_run_name="update-{agent}-v{version}")
def agent_update(agent: str, version: int, outcome: Future) -> dict | State:
    """One agent's update, from its step's admission until it is recorded and synced: reward, samples, tokens,
    loss and staleness of that update. ``outcome`` is settled in this process (``run_view.RunView``)."""
    try:
        event: UpdateEvent = outcome.result()
    except UpdateNotMade as exc:
        return Cancelled(message=str(exc))
    reward = "-" if event.mean_reward is None else f"{event.mean_reward:.3f}"
    skipped = " | SKIPPED (loss not finite, weights untouched; lower training.lr or check the rewards)"
    get_run_logger().info(
        "%s v%d | reward %s | %d samples | %d tokens | t=%.1fs%s", event.agent, event.policy_version, reward,
        event.samples, event.tokens, event.finished_at, skipped if event.skipped else "",
    )
    return update_row(event)


def update_row(event: UpdateEvent) -> dict:
    """One update as a row of the ``agent-updates`` table artifact."""
    return {
        "agent": event.agent,
        "version": event.policy_version,
        "mean_reward": event.mean_reward,
        "samples": event.samples,
        "tokens": event.tokens,
        "at_s": round(event.finished_at, 2),
        "staleness": event.staleness,
        "queue_depth": event.queue_depth,
        **{k: round(v, 6) for k, v in event.metrics.items()},
    }
