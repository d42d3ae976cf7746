"""What the Prefect UI shows of a running pipeline: a real task run per agent update, and Prefect events.

The pipeline runs on plain Dask and tells the flow what happens (``flexmarl.orchestrator.records``). The
``UpdateBoard`` turns that into Prefect objects at the grains Prefect can afford (a task run costs hundreds of
milliseconds of bookkeeping here, an event almost nothing):

- a step opened: one ``agent-update`` task run per agent that trains on it, named ``update-<agent>-v<version>``
  and tagged ``agent:<agent>``. It starts then and waits for the outcome the board posts for it through the
  run's Dask scheduler (``orchestrator/channel.py``), so it may run in any process: Completed once the update
  is recorded and every replica of the agent holds its weights, Failed with the agent's error when a task of
  that agent fails the run, Cancelled when the run stops first. Prefect's run graph draws the agents' updates side by
  side, overlapping when the pipeline runs them asynchronously. The scheduler admits at most
  ``max_staleness + 1`` steps ahead, so few of these wait at once (Prefect's thread pool is unbounded);
- micro-batch commits, weight syncs, slot moves, state moves, recoveries and updates (with their staleness):
  Prefect events named ``flexmarl.<what>``, about the resource ``flexmarl.run.<run id>.agent.<agent>``, which
  automations can act on; ``flexmarl.run.failed`` names the run directory of a failed run, which the
  ``resume-failed-runs`` automation (``deployments/automations.py``) resumes.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.futures import PrefectFuture, wait
from prefect.logging import get_run_logger
from prefect.states import Cancelled, State

from flexmarl.orchestrator.channel import AgentUpdateError, OutcomeRef, RunChannel, UpdateNotMade
from flexmarl.orchestrator.records import (
    AgentFailed,
    MicroBatchCommitted,
    PipelineEvent,
    Recovery,
    StateMove,
    StepOpened,
    UpdateEvent,
    WeightSynced,
)
from flexmarl.rollout.balancer import Move

EVENT_NAMES: dict[type, str] = {
    StepOpened: "flexmarl.step.opened",
    MicroBatchCommitted: "flexmarl.microbatch.committed",
    UpdateEvent: "flexmarl.agent.updated",
    WeightSynced: "flexmarl.weights.synced",
    StateMove: "flexmarl.state.moved",
    Move: "flexmarl.slot.moved",
    AgentFailed: "flexmarl.agent.failed",
}
FINAL_WAIT_S = 60.0  # for the waiting task runs to record their end once told, at the end of the run


@task(name="agent-update", cache_policy=NO_CACHE, task_run_name="update-{agent}-v{version}")
def agent_update(agent: str, version: int, outcome: OutcomeRef) -> dict | State:
    """One agent's update, from its step's admission until it is recorded and synced: reward, samples, tokens,
    loss and staleness of that update. It waits wherever it runs, on the outcome the flow posts for it."""
    try:
        event: UpdateEvent = outcome.wait()
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


class UpdateBoard:
    """The flow's view of a pipeline run: its waiting ``agent-update`` task runs and its events."""

    def __init__(self, channel: RunChannel) -> None:
        self.run_id, self.channel = channel.run_id, channel
        self.outcomes: dict[tuple[str, int], OutcomeRef] = {}  # (agent, version) -> what its task run waits for
        self.recorded: dict[tuple[str, int], UpdateEvent] = {}  # recorded, replicas not all synced yet
        self.runs: list[PrefectFuture] = []

    def on(self, event: PipelineEvent) -> UpdateEvent | None:
        """Show ``event`` in Prefect; returns it when it is a recorded update (for progress and trackers)."""
        self.emit(event)
        if isinstance(event, StepOpened):
            for agent in event.agents:
                outcome = self.channel.outcome_ref(agent, event.step + 1)
                self.outcomes[(agent, event.step + 1)] = outcome
                self.runs.append(agent_update.with_options(tags=[f"agent:{agent}"]).submit(
                    agent, event.step + 1, outcome))
        elif isinstance(event, UpdateEvent):
            self.recorded[(event.agent, event.policy_version)] = event
            return event
        elif isinstance(event, WeightSynced) and event.all_synced:
            for key in [k for k in self.recorded if k[0] == event.agent and k[1] <= event.version]:
                self._settle(key, self.recorded.pop(key))
        elif isinstance(event, AgentFailed):
            for key in [k for k in self.outcomes if k[0] == event.agent]:
                self._settle(key, AgentUpdateError(event.error))
        return None

    def close(self, why: str | None) -> None:
        """The pipeline ended (``why``: None when it finished): settle every update still waiting."""
        for key, event in list(self.recorded.items()):  # recorded: the run has it, whatever the last sync did
            self._settle(key, event)
        self.recorded.clear()
        for key in list(self.outcomes):
            self._settle(key, UpdateNotMade(f"the run ended before this update: {why or 'not admitted'}"))
        wait(self.runs, timeout=FINAL_WAIT_S)
        self.runs.clear()

    def _settle(self, key: tuple[str, int], value: UpdateEvent | BaseException) -> None:
        outcome = self.outcomes.pop(key, None)
        if outcome is not None:
            self.channel.post(outcome, value)

    def emit(self, event: PipelineEvent) -> None:
        if isinstance(event, Recovery):
            name = "flexmarl.recovery." + ("finished" if event.recovered_at is not None else "started")
        else:
            name = EVENT_NAMES[type(event)]
        agent = getattr(event, "target", None) or getattr(event, "agent", None)
        resource_id = f"flexmarl.run.{self.run_id}" + (f".agent.{agent}" if agent else "")
        emit_event(event=name, resource={"prefect.resource.id": resource_id, "flexmarl.run": self.run_id,
                                         "prefect.resource.name": agent or self.run_id},
                   payload=_jsonable(asdict(event)))


def emit_run_failed(run_id: str, run_dir: str, error: BaseException) -> None:
    """``flexmarl.run.failed``, with the run directory to resume (the ``resume-failed-runs`` automation's cue)."""
    emit_event(event="flexmarl.run.failed", resource={"prefect.resource.id": f"flexmarl.run.{run_id}",
                                                      "flexmarl.run": run_id, "prefect.resource.name": run_id},
               payload={"run_dir": str(Path(run_dir).resolve()), "error": f"{type(error).__name__}: {error}"})


def _jsonable(value):
    """``value`` with tuples as lists and non-finite floats (a skipped update's NaN loss) as None."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
