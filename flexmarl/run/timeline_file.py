"""``RUN_DIR/timeline.json``: the pipeline's worker spans, agent updates and queues, kept after the run.

The store holds what was sampled and trained; it does not hold when each worker was busy, the per-update
staleness, each agent's queue of waiting requests over time, the replicas the balancer moved, the
training states that moved, nor the recoveries. The pipeline task writes the whole ``PipelineResult`` here
at the end of a run: the flow's report is built from it, and ``flexmarl report`` draws the timeline and the
per-agent pictures from it later.

Example:
    >>> write_timeline(result, run_dir / TIMELINE_FILE)
    >>> read_timeline(run_dir / TIMELINE_FILE).utilization() == result.utilization()
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from flexmarl.orchestrator.records import PipelineResult, Recovery, Span, StateMove, UpdateEvent, WeightSynced
from flexmarl.rollout.balancer import Move

FORMAT = 1  # bumped when the layout changes, so that an old file is refused with a clear error


def write_timeline(result: PipelineResult, path: Path) -> Path:
    """Write ``result`` as JSON (times as given: spans absolute, update times relative to the start)."""
    data = {
        "format": FORMAT,
        "start": result.start,
        "wall_s": result.wall_s,
        "workers": result.workers,
        "tokens": result.tokens,
        "store_write_s": result.store_write_s,
        "store_read_s": result.store_read_s,
        "spans": [asdict(s) for s in result.spans],
        "updates": [asdict(u) for u in result.updates],
        "moves": [asdict(m) for m in result.moves],
        "queue_trace": result.queue_trace,
        "state_moves": [asdict(m) for m in result.state_moves],
        "samples_generated": result.samples_generated,
        "samples_reused": result.samples_reused,
        "recoveries": [asdict(r) for r in result.recoveries],
        "driver_busy_s": result.driver_busy_s,
        "syncs": [asdict(s) for s in result.syncs],
    }
    path.write_text(json.dumps(data))
    return path


def read_timeline(path: Path) -> PipelineResult:
    """The ``PipelineResult`` that ``write_timeline`` saved.

    Raises:
        ValueError: the file is not a timeline of this format.
    """
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); delete it to report "
                         "without the timeline") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a FlexMARL timeline of format {FORMAT}")
    return PipelineResult(
        start=data["start"],
        wall_s=data["wall_s"],
        spans=[Span(**s) for s in data["spans"]],
        updates=[UpdateEvent(**u) for u in data["updates"]],
        workers=data["workers"],
        tokens=data["tokens"],
        store_write_s=data["store_write_s"],
        store_read_s=data["store_read_s"],
        moves=[Move(**m) for m in data["moves"]],
        queue_trace=[tuple(q) for q in data["queue_trace"]],
        # absent from the files of older runs, which kept them only in report.json
        state_moves=[StateMove(**m) for m in data.get("state_moves", [])],
        samples_generated=data.get("samples_generated", 0),
        samples_reused=data.get("samples_reused", 0),
        recoveries=[Recovery(**{**r, "workers": tuple(r["workers"])}) for r in data.get("recoveries", [])],
        driver_busy_s=data.get("driver_busy_s", 0.0),
        syncs=[WeightSynced(**s) for s in data.get("syncs", [])],
    )
