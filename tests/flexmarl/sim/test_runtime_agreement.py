"""What the simulator repeats from the runtime (to stay free of torch and Dask) agrees with the runtime."""

from __future__ import annotations

from flexmarl.sim.engine import MODES


def test_modes_are_the_benchmarks_modes() -> None:
    from flexmarl.bench.pipeline_bench import MODES as BENCH_MODES

    for name, overrides in BENCH_MODES.items():
        settings = dict(o.split("=", 1) for o in overrides)
        mode = MODES[name]
        assert mode.mode == settings.get("train.mode", "flexmarl")
        assert mode.pipeline == (settings.get("train.pipeline", "true") == "true")
        assert mode.max_staleness == int(settings.get("train.max_staleness", 0))
        assert mode.load_balance == (settings.get("rollout.load_balance", "true") == "true")
