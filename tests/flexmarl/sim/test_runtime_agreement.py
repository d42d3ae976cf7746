"""What the simulator repeats from the runtime (to stay free of torch and Dask) agrees with the runtime."""

from __future__ import annotations

from flexmarl.sim.engine import MODES


def test_modes_are_the_benchmarks_modes() -> None:
    from flexmarl.bench.pipeline_bench import MODES as BENCH_MODES

    for name, overrides in BENCH_MODES.items():
        settings = dict(o.split("=", 1) for o in overrides)
        mode = MODES[name]
        assert mode.mode == settings.get("run.mode", "flexmarl")
        assert mode.pipeline == (settings.get("run.pipeline", "true") == "true")
        assert mode.max_staleness == int(settings.get("run.max_staleness", 0))
        assert mode.load_balance == (settings.get("rollout.load_balance", "true") == "true")
        cut = settings.get("rollout.micro_batch_generation")  # unset: the workload's own setting
        assert mode.micro_batch_generation == (None if cut is None else cut == "true")
        assert mode.max_slots == int(settings.get("training.max_slots", 1))


def test_the_simulator_and_the_runtime_drive_one_scheduler(parse_module) -> None:
    import ast
    from pathlib import Path

    import flexmarl
    from flexmarl.orchestrator import pipeline
    from flexmarl.orchestrator.scheduler import Scheduler
    from flexmarl.sim import engine

    assert engine.Scheduler is Scheduler and pipeline.Scheduler is Scheduler
    # no scheduling state is defined a second time anywhere in the package
    defined: dict[str, list[str]] = {}
    for path in Path(flexmarl.__file__).parent.rglob("*.py"):
        for node in ast.walk(parse_module(path)):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(str(path))
    for name in ("MicroBatch", "StepState", "Scheduler", "InFlight"):
        assert len(defined[name]) == 1, (name, defined[name])
