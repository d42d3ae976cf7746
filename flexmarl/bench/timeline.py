"""The timeline picture: one lane per worker, its rollout, training, swap and sync time in colours."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402

from flexmarl.orchestrator.records import PipelineResult  # noqa: E402

COLOURS = {"rollout": "#4caf50", "train": "#ff9800", "swap": "#e91e63", "sync": "#9e9e9e"}


def draw_timeline(result: PipelineResult, path: Path, *, title: str) -> Path:
    """Save a Gantt chart of ``result``'s spans; white is idle time."""
    lanes = {w: i for i, w in enumerate(result.workers)}
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(lanes)))
    for span in result.spans:
        # background work (a state read ahead) is a thin bar just under the lane, beside the tasks it overlaps
        y, height = (lanes[span.worker] - 0.52, 0.1) if span.background else (lanes[span.worker] - 0.4, 0.8)
        ax.broken_barh([(span.start - result.start, span.end - span.start)], (y, height),
                       facecolors=COLOURS.get(span.kind, "#2196f3"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), [f"worker {i}" for i in range(len(lanes))])
    ax.set_xlim(0, result.wall_s)
    ax.set_xlabel("seconds")
    ax.set_title(f"{title}: utilisation {result.utilization():.0%}, {result.wall_s:.1f} s", loc="left")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()], labels=list(COLOURS),
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncols=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
