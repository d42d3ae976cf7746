"""Pictures of a run's timeline: one lane per worker (its rollout, training, swap and sync time in colours),
and each agent's queue of waiting requests with the replicas the balancer moved."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402

from flexmarl.orchestrator.records import PipelineResult  # noqa: E402

COLOURS = {"rollout": "#4caf50", "train": "#ff9800", "swap": "#e91e63", "sync": "#9e9e9e", "snapshot": "#3f51b5"}


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


def draw_queues(result: PipelineResult, path: Path, *, title: str) -> Path:
    """Each agent's waiting requests over time; a dashed line where a replica moved to an agent."""
    fig, ax = plt.subplots(figsize=(10, 3))
    agents = sorted({a for _, a, _ in result.queue_trace})
    colours = dict(zip(agents, plt.get_cmap("tab10").colors, strict=False))
    for agent in agents:
        points = [(t, d) for t, a, d in result.queue_trace if a == agent] + [(result.wall_s, 0)]
        ax.step([t for t, _ in points], [d for _, d in points], where="post", label=agent, color=colours[agent])
    for move in result.moves:
        ax.axvline(move.at, color=colours.get(move.target, "grey"), linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("waiting requests")
    ax.set_title(f"{title}: {len(result.moves)} replica moves (dashed, in the colour of the agent that gained)",
                 loc="left")
    ax.legend(fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
