"""Experiments on the simulator: a preset's modes against the paper's table, and sweeps of agents and devices.

``run_preset`` simulates the modes of one preset and writes ``sim.json`` (the format ``flexmarl simulate``
documents) and timeline pictures; ``run_sweep`` grows the number of agents (2 to 64) or of devices (64 to
8,192) from the ``scale-15x14b`` preset and plots step time, utilisation and the simulator's own wall time.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import yaml

from flexmarl.sim.costmodel import SimPreset
from flexmarl.sim.engine import MODES, SimResult, simulate
from flexmarl.sim.timeline import draw_sim_timeline, draw_sweep

DEFAULT_MODES = ("sync", "flexmarl", "no-lb", "no-pipeline", "stale1")
SWEEPS = {
    "agents": (2, 4, 8, 16, 32, 64),
    "devices": (64, 128, 256, 512, 1024, 2048, 4096, 8192),
}
SWEEP_BASE = "scale-15x14b"


def check_modes(modes: Sequence[str]) -> list[str]:
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}" if unknown else
                         f"no modes given; choose from {', '.join(MODES)}")
    return list(modes)


def mode_summary(result: SimResult, sim_wall_s: float) -> dict:
    return {
        "step_s": result.step_s(),
        "utilization": result.utilization(),
        "tokens_per_s": result.tokens / result.wall_s if result.wall_s else 0.0,
        "wall_s": result.wall_s,  # simulated seconds for all steps (the first one fills the pipeline)
        "steps": result.steps,
        "slot_moves": len(result.moves),
        "events": result.events,
        "sim_wall_s": sim_wall_s,
    }


def ratios(modes: dict[str, dict]) -> dict[str, float | None]:
    """Our counterparts of the paper's three ratios, from seconds per step (None when a mode is missing)."""
    def ratio(slow: str) -> float | None:
        if slow in modes and "flexmarl" in modes:
            return modes[slow]["step_s"] / modes["flexmarl"]["step_s"]
        return None

    return {"speedup_vs_marti": ratio("sync"), "lb_ablation": ratio("no-lb"), "pipeline_ablation": ratio("no-pipeline")}


def run_preset(
    preset: SimPreset,
    modes: Sequence[str] = DEFAULT_MODES,
    *,
    steps: int | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Simulate ``modes`` of ``preset``; write ``out_dir/sim.json`` and ``timeline_<mode>.png`` when given.

    Returns the report: preset, devices, agents, per-mode step time, utilisation and tokens/s, speedups over
    ``sync``, and the paper's three ratios beside ours.
    """
    modes = check_modes(modes)
    report: dict = {
        "preset": preset.name,
        "devices": preset.cluster.total_devices,
        "agents": len(preset.agents),
        "modes": {},
    }
    started = time.perf_counter()
    for mode in modes:
        t0 = time.perf_counter()
        result = simulate(preset, mode, steps=steps)
        summary = mode_summary(result, time.perf_counter() - t0)
        report["modes"][mode] = summary
        log(f"{mode}: {summary['step_s']:.1f} s/step, utilisation {summary['utilization']:.0%}, "
            f"simulated in {summary['sim_wall_s']:.2f} s")
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            draw_sim_timeline(result, out_dir / f"timeline_{mode}.png", title=f"{preset.name} {mode}")
    report["sim_wall_s"] = time.perf_counter() - started
    if "sync" in report["modes"]:
        base = report["modes"]["sync"]["step_s"]
        report["speedup_vs_sync"] = {m: base / r["step_s"] for m, r in report["modes"].items()}
    else:
        report["speedup_vs_sync"] = {}
    report["paper"] = preset.paper.ratios() if preset.paper else None
    report["ours"] = ratios(report["modes"])
    if preset.paper:
        report["within_25pct"] = {
            k: None if report["ours"][k] is None else abs(report["ours"][k] / v - 1) <= 0.25
            for k, v in report["paper"].items()
        }
    if out_dir is not None:
        (out_dir / "sim.json").write_text(json.dumps(report, indent=2))
    return report


# ---------------------------------------------------------------------- sweeps


def base_preset_data(name: str = SWEEP_BASE) -> dict:
    return yaml.safe_load(resources.files("flexmarl.sim.presets").joinpath(f"{name}.yaml").read_text())


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def preset_with_agents(n: int, base: dict | None = None) -> SimPreset:
    """The base preset's cluster and costs with ``n`` agents: router -> n - 2 specialists -> summariser.

    Specialists reuse the base's response lengths in turn, and its skewed fan-out (4, 3, 2, 2, 2 requests per
    episode, then 1); the MARTI-like layout gives the agents one group of nodes each, up to one node per agent.
    """
    if n < 2:
        raise ValueError(f"a sweep point needs at least 2 agents (router and summariser), got {n}")
    data = copy.deepcopy(base or base_preset_data())
    agents = data["agents"]
    router, summariser = agents["router"], agents["summariser"]
    specialists = [v for k, v in agents.items() if k not in ("router", "summariser")]
    fan = [4, 3, 2, 2, 2]
    new_agents = {"router": router}
    nodes = [{"name": "route", "agent": "router"}]
    edges = []
    for i in range(n - 2):
        name = f"specialist_{i:02d}"
        new_agents[name] = specialists[i % len(specialists)]
        nodes.append({"name": f"{name}_task", "agent": name, "copies": fan[i] if i < len(fan) else 1})
        edges += [["route", f"{name}_task"], [f"{name}_task", "summarise"]]
    new_agents["summariser"] = summariser
    nodes.append({"name": "summarise", "agent": "summariser"})
    if n == 2:
        edges = [["route", "summarise"]]
    data.update(name=f"{data['name']}-{n}-agents", agents=new_agents, graph={"nodes": nodes, "edges": edges})
    nodes_total = data["cluster"]["nodes"]
    groups = _largest_divisor_at_most(nodes_total, n)
    data["cluster"]["sync_layout"].update(
        workers=groups, devices_per_worker=nodes_total * data["cluster"]["devices_per_node"] // groups)
    return SimPreset.model_validate(data)


def preset_with_devices(devices: int, base: dict | None = None) -> SimPreset:
    """The base preset's agents and costs on ``devices`` devices (whole nodes of the base's size).

    About a third of the nodes train (slots of two nodes), the rest roll out; the MARTI-like layout splits the
    nodes into up to 15 equal colocated groups.
    """
    data = copy.deepcopy(base or base_preset_data())
    per_node = data["cluster"]["devices_per_node"]
    if devices % per_node or devices < 4 * per_node:
        raise ValueError(f"devices must be a multiple of {per_node} and at least {4 * per_node}, got {devices}")
    nodes = devices // per_node
    training_nodes = max(2, 2 * round(nodes / 6))
    layout = data["cluster"]["layout"]
    layout.update(workers=nodes - training_nodes, devices_per_worker=per_node, training_slots=training_nodes // 2,
                  devices_per_slot=2 * per_node)
    groups = _largest_divisor_at_most(nodes, 15)
    data["cluster"]["sync_layout"].update(workers=groups, devices_per_worker=devices // groups)
    data["cluster"]["nodes"] = nodes
    data["name"] = f"{data['name']}-{devices}-devices"
    return SimPreset.model_validate(data)


def run_sweep(
    kind: str,
    *,
    modes: Sequence[str] = ("sync", "flexmarl"),
    steps: int = 5,
    values: Sequence[int] | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Step time, utilisation and simulation wall time as the agents or the devices grow.

    Writes ``out_dir/sweep_<kind>.json`` and ``sweep_<kind>.png`` when ``out_dir`` is given.
    """
    if kind not in SWEEPS:
        raise ValueError(f"unknown sweep {kind!r}; choose from {', '.join(SWEEPS)}")
    modes = check_modes(modes)
    build = preset_with_agents if kind == "agents" else preset_with_devices
    base = base_preset_data()
    report: dict = {"sweep": kind, "base": SWEEP_BASE, "steps": steps, "points": []}
    for value in values or SWEEPS[kind]:
        preset = build(value, base)
        point: dict = {kind: value, "devices": preset.cluster.total_devices, "agents": len(preset.agents),
                       "requests_per_episode": len(preset.expanded.nodes), "modes": {}}
        for mode in modes:
            t0 = time.perf_counter()
            result = simulate(preset, mode, steps=steps)
            point["modes"][mode] = mode_summary(result, time.perf_counter() - t0)
        report["points"].append(point)
        log(f"{kind}={value}: " + ", ".join(
            f"{m} {r['step_s']:.1f} s/step ({r['sim_wall_s']:.1f} s to simulate)" for m, r in point["modes"].items()))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"sweep_{kind}.json").write_text(json.dumps(report, indent=2))
        draw_sweep(report, out_dir / f"sweep_{kind}.png")
    return report
