"""``flexmarl report``: write a run's pictures, ``report.md`` and ``report.html`` into one folder.

Example:
    >>> files = write_report(RunDirectory("runs/tiny"), Path("runs/tiny/report"))
    >>> files.html
    PosixPath('runs/tiny/report/report.html')
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

from flexmarl.report.meg_picture import draw_run_meg
from flexmarl.report.pictures import draw_agent_sheet, draw_rewards
from flexmarl.report.series import load_series
from flexmarl.report.summary import render_summary
from flexmarl.report.timeline import draw_queues, draw_timeline
from flexmarl.run.directory import RunDirectory

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #212121; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
th { background: #f5f5f5; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    pictures: dict[str, Path]  # caption -> PNG


def write_report(run: RunDirectory, out_dir: Path) -> ReportFiles:
    """Draw the pictures and write ``report.md`` and ``report.html`` (which link the PNGs beside them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline = run.timeline()
    report = run.report()
    series = load_series(run, timeline)
    pictures: dict[str, Path] = {
        "rewards of all agents": draw_rewards(list(series.values()), out_dir / "rewards.png"),
        "the multi-agent execution graph": draw_run_meg(run.config, out_dir / "meg.png"),
    }
    for agent, s in series.items():
        pictures[f"agent {agent}"] = draw_agent_sheet(s, out_dir / f"agent_{agent}.png")
    if timeline is not None and timeline.spans:
        pictures["worker timeline"] = draw_timeline(timeline, out_dir / "timeline.png", title="workers")
    if timeline is not None and timeline.queue_trace:
        pictures["queues and slot moves"] = draw_queues(timeline, out_dir / "queues.png", title="waiting requests")
    text = render_summary(run, series, report=report, timeline=timeline,
                          pictures={caption: p.name for caption, p in pictures.items()})
    md = out_dir / "report.md"
    md.write_text(text)
    page = out_dir / "report.html"
    title = html.escape(text.splitlines()[0].lstrip("# ").replace("`", ""))
    body = MarkdownIt("commonmark").enable("table").render(text)
    page.write_text(f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{title}</title>"
                    f"<style>{STYLE}</style></head>\n<body>\n{body}</body></html>\n")
    return ReportFiles(md, page, pictures)
