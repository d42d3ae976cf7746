"""What the simulator repeats from the runtime (to stay free of torch and Dask) agrees with the runtime."""

from __future__ import annotations

import pytest

from flexmarl.orchestrator.policy import TASK_PRIORITY, SchedulePolicy
from flexmarl.sim.engine import MODES, deal_slots


def test_modes_are_the_benchmarks_modes() -> None:
    from flexmarl.bench.pipeline_bench import MODES as BENCH_MODES

    for name, overrides in BENCH_MODES.items():
        settings = dict(o.split("=", 1) for o in overrides)
        mode = MODES[name]
        assert mode.mode == settings.get("train.mode", "flexmarl")
        assert mode.pipeline == (settings.get("train.pipeline", "true") == "true")
        assert mode.max_staleness == int(settings.get("train.max_staleness", 0))
        assert mode.load_balance == (settings.get("rollout.load_balance", "true") == "true")


@pytest.mark.parametrize(("agents", "workers", "per_worker"), [(3, 2, 2), (5, 2, 1), (6, 40, 2), (15, 4, 2)])
def test_replica_slots_are_dealt_as_the_runtime_deals_them(agents: int, workers: int, per_worker: int) -> None:
    from flexmarl.orchestrator.runtime import deal_slots as runtime_deal_slots

    names, hosts = [f"a{i}" for i in range(agents)], [f"w{i}" for i in range(workers)]
    assert deal_slots(names, hosts, per_worker) == runtime_deal_slots(names, hosts, per_worker)


def test_the_pipelines_constants_are_the_policys() -> None:
    from flexmarl.orchestrator import pipeline

    assert pipeline.PRIORITY == TASK_PRIORITY
    assert pipeline.QUEUE_DEPTH == SchedulePolicy.__dataclass_fields__["queue_depth"].default
