"""Reading a finished run (its config, report, timeline, store and checkpoints) imports neither Dask nor torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexmarl.config import dump_config, load_config
from flexmarl.orchestrator.records import PipelineResult, Span
from flexmarl.run.layout import CONFIG_FILE, REPORT_FILE, STORE_DIR, TIMELINE_FILE
from flexmarl.run.timeline_file import write_timeline
from storage.store import ExperienceStore

READ = """
import sys
from flexmarl.run.directory import RunDirectory
from flexmarl.report.series import load_series
from flexmarl.report.summary import render_summary
run = RunDirectory(sys.argv[1])
assert run.timeline().spans[0].worker == "w0" and run.report() == {"ok": True}
assert run.store.version("updates") >= 0 and run.checkpoints("solver") == {}
print(sorted(m for m in ("torch", "transformers", "distributed", "dask") if m in sys.modules))
"""


def test_reading_a_finished_run_imports_neither_dask_nor_torch(tmp_path: Path) -> None:
    cfg = load_config(preset="tiny")
    (tmp_path / CONFIG_FILE).write_text(dump_config(cfg))
    ExperienceStore(tmp_path / STORE_DIR).create(list(cfg.agents))
    write_timeline(PipelineResult(0.0, 1.0, [Span("w0", "train", "solver", 0.0, 0.5)], [], ["w0"], 0),
                   tmp_path / TIMELINE_FILE)
    (tmp_path / REPORT_FILE).write_text(json.dumps({"ok": True}))
    # a new interpreter: this one has imported everything already
    out = subprocess.run([sys.executable, "-c", READ, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_what_each_agent_learned_compares_its_first_and_last_updates() -> None:
    from flexmarl.report.summary import learned_lines

    report = {"agents": {"solver": {"mean_reward": [0.1, 0.3, None, 0.5, 0.7]}, "verifier": {"mean_reward": [0.4]}}}
    assert learned_lines(report, window=2) == [
        "solver: mean training reward 0.20 over updates 1-2, 0.60 over updates 4-5",
        "verifier: too few updates with a reward to compare (1)",
    ]
