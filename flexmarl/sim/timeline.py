"""Pictures of simulated runs: a timeline of a sample of workers, and sweep curves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flexmarl.sim.engine import SPAN_KINDS, SimResult  # noqa: E402

from flexmarl.report.timeline import COLOURS  # noqa: E402 - the runtime's timeline colours


def sample_workers(result: SimResult, rollout: int = 8, training: int = 8) -> list[int]:
    """Indices of the workers to draw: the first rollout workers and the first training slots."""
    roll = [i for i, w in enumerate(result.workers) if w.role in ("rollout", "both")][:rollout]
    train = [i for i, w in enumerate(result.workers) if w.role == "train"][:training]
    return roll + train


def draw_sim_timeline(result: SimResult, path: Path, *, title: str, lanes: list[int] | None = None) -> Path:
    """Save a Gantt chart of a sample of ``result``'s workers (white is idle time)."""
    lanes = lanes if lanes is not None else sample_workers(result)
    row = {w: i for i, w in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.35 * len(lanes)))
    keep = np.isin(result.span_worker, lanes)
    for kind_index, kind in enumerate(SPAN_KINDS):
        sel = keep & (result.span_kind == kind_index)
        for w in lanes:
            mine = sel & (result.span_worker == w)
            if mine.any():
                bars = list(zip(result.span_start[mine], result.span_end[mine] - result.span_start[mine], strict=True))
                ax.broken_barh(bars, (row[w] - 0.4, 0.8), facecolors=COLOURS[kind], edgecolor="none")
    labels = [f"{result.workers[w].name} ({result.workers[w].devices} dev)" for w in lanes]
    ax.set_yticks(range(len(lanes)), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, result.wall_s)
    ax.set_xlabel("simulated seconds")
    ax.set_title(f"{title}: {result.step_s():.1f} s/step, utilisation {result.utilization():.0%} "
                 f"({len(lanes)} of {len(result.workers)} workers)", loc="left", fontsize="medium")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()], labels=list(COLOURS),
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncols=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_sweep(report: dict, path: Path) -> Path:
    """Step time, utilisation and simulation wall time against the swept quantity, one line per mode."""
    kind = report["sweep"]
    xs = [p[kind] for p in report["points"]]
    modes = list(report["points"][0]["modes"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("step_s", "seconds per step"), ("utilization", "utilisation"), ("sim_wall_s", "simulation wall s"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for mode in modes:
            ax.plot(xs, [p["modes"][mode][key] for p in report["points"]], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs], fontsize="small")
        ax.set_xlabel(kind)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    axes[0].legend(fontsize="small")
    fig.suptitle(f"sweep over {kind} ({report['base']}, {report['steps']} steps per point)", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
