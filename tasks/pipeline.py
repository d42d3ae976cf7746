from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, State

from flexmarl.orchestrator.channel import StopSignal
from flexmarl.orchestrator.pipeline import PipelineStopped
from flexmarl.orchestrator.runtime import Placement, RunContext, Runtime
from flexmarl.run.layout import TIMELINE_FILE
from flexmarl.run.timeline_file import write_timeline
from tasks.run_view import RunView


@dataclass(frozen=True)
class PipelineOutcome:
    timeline: str  # RUN_DIR/timeline.json: every worker's spans and updates
    placement: Placement  # where the engines are now: agents may have moved between slots


@task(name="rollout-and-train", cache_policy=NO_CACHE, cache_result_in_memory=False)
def run_pipeline(ctx: RunContext, placement: Placement) -> PipelineOutcome | State:
    """The whole rollout stream and every agent's micro-batch training, on Dask, for ``run.steps`` steps;
    returns the path of the timeline it writes and where the engines are at the end.

    Generation batches and micro-batches are plain Dask tasks inside. This task also shows the run as it goes
    (``run_view.py``): an ``agent-update`` task run per agent update, Prefect events, the progress artifact,
    the experiment trackers. Stopped by the flow (Ctrl-C, SIGTERM, a failure elsewhere), it ends Cancelled: a
    stop on request, resumable from the store, is no task failure.
    """
    runtime = Runtime(ctx, placement=placement)
    try:
        with RunView(ctx, runtime.cfg, placement.versions) as view:
            stop = StopSignal(runtime.client, ctx.run_id, also=view.failed)
            result = runtime.run(on_event=view.put, stop_requested=stop)
    except PipelineStopped as exc:
        return Cancelled(message=str(exc))
    finally:
        runtime.disconnect()
    return PipelineOutcome(str(write_timeline(result, Path(ctx.run_dir, TIMELINE_FILE))), runtime.placement)
