"""timeline.json: the pipeline's spans and update events survive the run, and a bad file is refused."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from flexmarl.orchestrator.records import PipelineResult, Recovery, Span, StateMove, UpdateEvent, WeightSynced
from flexmarl.rollout.balancer import Move
from flexmarl.run.timeline_file import read_timeline, write_timeline


def test_a_written_timeline_reads_back_equal(tmp_path: Path) -> None:
    result = PipelineResult(
        start=1000.0, wall_s=4.0,
        spans=[Span("w0", "rollout", "solver", 1000.0, 1001.5), Span("w1", "train", "solver", 1001.5, 1003.0)],
        updates=[UpdateEvent("solver", 0, 1, 16, 200, 0.5, {"loss/policy": 0.1}, 3.0, staleness=0.5, queue_depth=2,
                             driver_busy_s=1.2)],
        workers=["w0", "w1"], tokens=200, store_write_s=0.2, store_read_s=0.1,
        moves=[Move(1.2, "verifier", "solver", 0.0, 6.0)], queue_trace=[(0.0, "solver", 8), (1.5, "solver", 0)],
        state_moves=[StateMove("solver", "w1", 0.3, True, 0.2)], samples_generated=24, samples_reused=8,
        recoveries=[Recovery(("w2",), "lost", 1002.0, 1003.5)], driver_busy_s=1.5,
        syncs=[WeightSynced("solver", 1, "w0", 0.25, 538_000_000, True)],
    )
    # every field: the flow's report is built from this file, so a field left out reads back as its default
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(PipelineResult)
                if f.default is not MISSING or f.default_factory is not MISSING}
    assert all(getattr(result, name) != default for name, default in defaults.items())
    back = read_timeline(write_timeline(result, tmp_path / "timeline.json"))
    assert back == result
    assert back.utilization() == pytest.approx(3.0 / 8.0)
    assert back.driver_busy_share() == pytest.approx(1.5 / 4.0)


def test_the_driver_busy_share_is_cut_into_one_window_per_step() -> None:
    def update(agent: str, step: int, at: float, busy: float) -> UpdateEvent:
        return UpdateEvent(agent, step, step + 1, 8, 80, None, {}, at, driver_busy_s=busy)

    # step 0 ends with b's update at 4 s; step 1's window runs from there to its last update, at 9 s
    result = PipelineResult(0.0, 10.0, [], [update("a", 0, 2.0, 0.5), update("a", 1, 5.0, 1.2),
                                            update("b", 0, 4.0, 1.0), update("b", 1, 9.0, 1.4)], ["w0"], 160)
    assert result.driver_busy_by_step() == {0: pytest.approx(1.0 / 4.0), 1: pytest.approx(0.4 / 5.0)}


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a FlexMARL timeline of format 1"):
        read_timeline(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_timeline(path)
