"""A picture of a run's multi-agent execution graph, as the rollout runs it.

The expanded graph (``graph.expanded``): each copy of a fan-out node and each turn of a loop is its own
box, coloured by the agent that answers it, in columns by depth; an arrow is an edge, a dashed one a loop's
next turn. It goes into the flow run's artifacts at the start of a run (``tasks/publish.py``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: pictures are written headless
import matplotlib.pyplot as plt  # noqa: E402

from flexmarl.config import RunConfig  # noqa: E402
from flexmarl.meg.graph import ExpandedGraph  # noqa: E402

COLOURS = ["#1976d2", "#e65100", "#2e7d32", "#6a1b9a", "#c62828", "#00838f", "#5d4037", "#455a64"]
BOX_W, BOX_H = 1.6, 0.6


def layout(graph: ExpandedGraph) -> dict[str, tuple[float, float]]:
    """Each node's centre: its column is its depth (longest path from a root), its row its place there."""
    depth: dict[str, int] = {}
    for name in graph.order():
        depth[name] = 1 + max((depth[p] for p in graph.parents(name)), default=-1)
    columns: dict[int, list[str]] = {}
    for name in graph.order():
        columns.setdefault(depth[name], []).append(name)
    pos = {}
    for col, names in columns.items():
        for row, name in enumerate(names):
            pos[name] = (col * 2.4, -(row - (len(names) - 1) / 2) * 1.0)
    return pos


def draw_run_meg(cfg: RunConfig, path: Path) -> Path:
    """The MEG of a run's config, each agent's model in the legend."""
    agents = ", ".join(cfg.agents)
    return draw_meg(cfg.graph.expanded, {a: s.model for a, s in cfg.agents.items()}, path,
                    title=f"multi-agent execution graph: {len(cfg.graph.expanded.nodes)} nodes, agents {agents}")


def draw_meg(graph: ExpandedGraph, models: dict[str, str], path: Path, *, title: str) -> Path:
    """Draw ``graph`` (agents' models in the legend) to ``path`` (PNG); returns the path."""
    pos = layout(graph)
    agents = list(dict.fromkeys(n.agent for n in graph.nodes))
    colour = {a: COLOURS[i % len(COLOURS)] for i, a in enumerate(agents)}
    xs, ys = [x for x, _ in pos.values()], [y for _, y in pos.values()]
    width, height = max(xs) - min(xs) + 3, max(ys) - min(ys) + 2
    fig, ax = plt.subplots(figsize=(min(2 + width * 1.1, 16), min(1.6 + height * 0.9, 12)))
    for parent, child in graph.edges:
        (x0, y0), (x1, y1) = pos[parent], pos[child]
        loop = graph.node(parent).source == graph.node(child).source  # a loop's next turn
        skips = x1 - x0 > 2.5 * 1.01  # passes a column: arc over the boxes between
        ax.annotate("", xy=(x1, y1 + BOX_H / 2) if skips else (x1 - BOX_W / 2, y1),
                    xytext=(x0, y0 + BOX_H / 2) if skips else (x0 + BOX_W / 2, y0),
                    arrowprops={"arrowstyle": "->", "color": "#424242", "linestyle": "--" if loop else "-",
                                "shrinkA": 2, "shrinkB": 2, "connectionstyle": f"arc3,rad={-0.4 if skips else 0}"})
    for node in graph.nodes:
        x, y = pos[node.name]
        ax.add_patch(plt.Rectangle((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, facecolor=colour[node.agent],
                                   alpha=0.85, edgecolor="#212121"))
        ax.text(x, y, node.name, ha="center", va="center", color="white", fontsize="small", weight="bold")
    for agent in agents:
        ax.plot([], [], "s", color=colour[agent], label=f"{agent} ({models.get(agent, '?')})")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.02), fontsize="small", frameon=False,
              ncol=min(len(agents), 3))
    ax.set_xlim(min(xs) - BOX_W, max(xs) + BOX_W)
    ax.set_ylim(min(ys) - 1, max(ys) + 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, loc="left", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
