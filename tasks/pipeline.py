from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, State

from flexmarl.orchestrator.pipeline import PipelineStopped
from flexmarl.orchestrator.runtime import RunContext, Runtime
from flexmarl.run.layout import TIMELINE_FILE
from flexmarl.run.timeline_file import write_timeline


@task(name="rollout-and-train", cache_policy=NO_CACHE, cache_result_in_memory=False)
def run_pipeline(ctx: RunContext) -> str | State:
    """The whole rollout stream and every agent's micro-batch training, on Dask, for ``train.steps`` steps;
    returns the path of the timeline it writes (RUN_DIR/timeline.json: every worker's spans and updates).

    Generation batches and micro-batches are plain Dask tasks inside; the flow shows each agent update as its
    own ``agent-update`` task run (``tasks/updates.py``). Stopped by the flow (Ctrl-C, SIGTERM, a
    failure elsewhere), it ends Cancelled: a stop on request, resumable from the store, is no task failure.
    """
    try:
        result = Runtime.get(ctx).run()
    except PipelineStopped as exc:
        return Cancelled(message=str(exc))
    return str(write_timeline(result, Path(ctx.run_dir, TIMELINE_FILE)))
