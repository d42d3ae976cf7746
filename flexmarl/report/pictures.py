"""The report's pictures: one sheet per agent (each metric against step and against wall time), the agents'
rewards side by side, and the worker timeline.

Each function takes series (``series.py``) or a ``PipelineResult``, writes one PNG and returns its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: reports are written headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from flexmarl.report.series import AgentSeries  # noqa: E402

DPI = 100
# (title, y label, attribute, which x axis: "step" series or "update" series)
METRICS = [
    ("reward", "mean reward", "reward", "step"),
    ("loss", "policy loss", "loss", "update"),
    ("KL to the reference", "KL (k3, per token)", "kl", "update"),
    ("entropy (estimate)", "nats per token", "entropy", "step"),
    ("staleness", "versions behind", "staleness", "update"),
    ("queue depth", "waiting requests", "queue_depth", "update"),
    ("tokens/s", "trained tokens / s", "tokens_per_s", "update"),
]


def draw_agent_sheet(series: AgentSeries, path: Path) -> Path:
    """One agent's metrics: a row per metric, against the training step (left) and wall time (right)."""
    rows = len(METRICS) + 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 2.1 * rows), squeeze=False)
    for row, (title, ylabel, attr, kind) in enumerate(METRICS):
        values = getattr(series, attr)
        # one x axis for the whole sheet, the training step: the update of step s consumes that step's batch
        # and produces policy version s + 1
        if kind == "step":
            xs, times = series.steps, series.step_end_s
        else:
            xs, times = [v - 1 for v in series.versions], series.update_s
        xlabel = "training step"
        _line(axes[row][0], xs, values, title=title, xlabel=xlabel, ylabel=ylabel,
              missing=_why_missing(series, attr))
        if attr == "queue_depth" and series.queue_s:  # over time: every change, not only at the updates
            axes[row][1].step(series.queue_s, series.queue, where="post", color="#1976d2")
            _label(axes[row][1], title, "seconds since start", ylabel)
        else:
            _line(axes[row][1], times, values, title=title, xlabel="seconds since start", ylabel=ylabel,
                  missing=_why_missing(series, attr))
        if any(v is not None for v in values):
            axes[row][0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole
    # samples: per policy version (left), cumulative over wall time (right)
    left, right = axes[rows - 1]
    if series.samples_by_version:
        left.bar(list(series.samples_by_version), list(series.samples_by_version.values()), color="#4caf50")
        left.set_xticks(list(series.samples_by_version))
    _label(left, "samples per policy version", "policy version that generated them (v = step, on-policy)",
           "samples")
    if series.sample_times_s:
        right.step(series.sample_times_s, range(1, len(series.sample_times_s) + 1), where="post", color="#4caf50")
    _label(right, "samples generated", "seconds since start", "samples (cumulative)")
    fig.suptitle(f"agent {series.agent}", x=0.01, ha="left", fontsize="large")
    fig.tight_layout(rect=(0, 0, 1, 0.99))  # leave the top strip to the sheet's title
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def draw_rewards(all_series: Sequence[AgentSeries], path: Path) -> Path:
    """Every agent's mean reward by step and over wall time, on shared axes."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.2))
    for s in all_series:
        pts = [(x, t, y) for x, t, y in zip(s.steps, s.step_end_s, s.reward, strict=True) if y is not None]
        by_step.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=s.agent)
        by_time.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=s.agent)
    _label(by_step, "mean reward", "training step", "mean reward")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    _label(by_time, "mean reward", "seconds since start", "mean reward")
    by_step.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _line(ax: Axes, xs: Sequence[float], ys: Sequence[float | None], *, title: str, xlabel: str, ylabel: str,
          missing: str) -> None:
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color="#1976d2")
    else:
        ax.text(0.5, 0.5, missing, ha="center", va="center", transform=ax.transAxes, color="#757575")
        ax.set_xticks([])
        ax.set_yticks([])
    _label(ax, title, xlabel, ylabel)


def _label(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, loc="left", fontsize="medium")
    ax.set_xlabel(xlabel, fontsize="small")
    ax.set_ylabel(ylabel, fontsize="small")
    ax.tick_params(labelsize="small")
    ax.grid(alpha=0.3)


def _why_missing(series: AgentSeries, attr: str) -> str:
    if attr == "kl":
        return "not logged: training.kl_coef is 0"
    if attr in ("staleness", "queue_depth"):
        return "no timeline.json in the run directory"
    return "no data yet"


def draw_learning(report: dict, path: Path) -> Path:
    """The learning bench: each agent's training reward by step (left; the single solver's dashed), and the
    held-out accuracy of the base solver, the trained solver alone, the trained team and the single solver at
    equal compute, with 95% Wilson intervals (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    curves = [(agent, rewards, "-") for agent, rewards in report["train_reward_by_step"].items()]
    curves += [(f"{agent} (single)", rewards, "--")
               for agent, rewards in report.get("single_train_reward_by_step", {}).items()]
    for label, rewards, style in curves:
        steps = [i for i, r in enumerate(rewards) if r is not None]
        left.plot(steps, [rewards[i] for i in steps], style, marker=".", label=label)
    left.legend()
    _label(left, "training reward (sampled)", "training step", "mean reward")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    bars = [(name, report[key]) for name, key in (
        ("base solver", "base_accuracy"), ("trained solver\nalone", "solver_accuracy"),
        ("trained team", "team_accuracy"),
        ("single solver,\nequal compute", "single_equal_compute_accuracy"),
        (f"its majority\nof {report.get('majority_k', 0)}", "majority_vote_accuracy")) if key in report]
    for i, (name, p) in enumerate(bars):
        lo, hi = p["interval"]
        right.bar(i, p["accuracy"], color="#1976d2" if name == "trained team" else "#9e9e9e",
                  yerr=[[max(p["accuracy"] - lo, 0.0)], [max(hi - p["accuracy"], 0.0)]], capsize=4)
    right.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    _label(right, f"accuracy, greedy (n={report['n_eval']} held-out)", "", "accuracy (95% Wilson)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def draw_mode_rewards(report: dict, path: Path) -> Path:
    """``bench pipeline``: each agent's reward against step (left) and wall time (right), one line per mode.
    At staleness 0 every mode trains the same weights, so the left curves coincide and the right ones show
    which schedule reaches a reward first."""
    agents = sorted({a for r in report["modes"].values() for a in r["per_agent"]})
    fig, axes = plt.subplots(len(agents), 2, figsize=(11, 3 * len(agents)), squeeze=False)
    for row, agent in enumerate(agents):
        for mode, r in report["modes"].items():
            a = r["per_agent"].get(agent)
            if not a:
                continue
            axes[row][0].plot(range(1, len(a["reward"]) + 1), a["reward"], marker=".", label=mode)
            axes[row][1].plot(a["finished_at"], a["reward"], marker=".", label=mode)
        for ax, xlabel in zip(axes[row], ("update (policy version)", "seconds since start"), strict=True):
            ax.axhline(report.get("reward_threshold", 0.5), color="#bdbdbd", linestyle="--", linewidth=1)
            _label(ax, f"{agent}: mean reward", xlabel, "reward")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
