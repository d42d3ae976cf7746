"""An agent's trainer sharded over two Dask worker processes (``training.sharding``: FSDP2 or ZeRO-1 over a
real gloo world), each rank training its part of every micro-batch; parked as a distributed checkpoint and
resumed over another number of ranks."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from distributed import Client, LocalCluster

from flexmarl.cluster.local import submit_on, worker_env
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.reference import weight_drift
from flexmarl.training import sharding, slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import Rendezvous, TrainerGroup
from flexmarl.training.trainer import AgentTrainer, TrainBatch

from .test_trainer import make_batch

pytestmark = pytest.mark.cluster  # two worker processes: FSDP2 wants one world per process
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run on the workers

CONFIG = TrainerConfig(lr=1e-3, lr_warmup_steps=2, micro_batch_size=3, loss_type="dapo")
SLICES = [(0, 3), (3, 6), (6, 8), (8, 9)]  # parts of 2+1, 2+1, 1+1 and 1+none (one rank idle)


def train(key: EngineKey, batch: TrainBatch, start: int, stop: int) -> None:
    slot.trainer(key).accumulate(batch.slice(start, stop))


def held_bytes(key: EngineKey) -> tuple[int, int]:
    """This rank's bytes of the weights and of the optimizer's state."""
    held = slot.trainer(key)
    weights = sharding.local_bytes(held.policy_state())
    return weights, sharding.held_bytes(held.policy_state(), held.optimizer) - weights


def version(key: EngineKey) -> int:
    return slot.trainer(key).version


@pytest.fixture(scope="module")
def workers():
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                       env=worker_env()) as cluster, Client(cluster) as client):
        register(client)
        members = tuple(sorted(client.scheduler_info(n_workers=-1)["workers"]))
        yield client, members, Rendezvous(cluster.scheduler_address)


def on(client: Client, members: tuple[str, ...], fn, *args) -> list:
    """``fn(*args)`` on every member at once (a collective), the results in rank order."""
    return client.gather([submit_on(client, w, fn, *args) for w in members])


def step(client, members, key: EngineKey, batch: TrainBatch, group: TrainerGroup):
    for start, stop in SLICES:
        on(client, members, train, key, batch, start, stop)
    return on(client, members, slot.finish_step, key, group)


def reference_step(trainer: AgentTrainer, batch: TrainBatch):
    trainer.begin_step()
    for start, stop in SLICES:
        trainer.accumulate(batch.slice(start, stop))
    return trainer.finish_step()


def state(key: EngineKey) -> dict[str, torch.Tensor]:
    held = slot.trainer(key)
    return sharding.full_state(held.model, held.optimizer)


@pytest.mark.parametrize("mode", ["full", "optimizer"])
def test_a_sharded_trainer_steps_as_one_slot_holding_half_the_state_and_resumes_over_another_count(
        mode, tiny_dir, workers, tmp_path) -> None:
    client, members, rendezvous = workers
    sharded = CONFIG.model_copy(update={"sharding": mode})
    key = EngineKey(f"run-{mode}", "solver")
    batches = [make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -1.5, 1.5, 1.0][::sign]) for sign in (1, -1)]
    reference = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0, max_new_tokens=6)
    start = reference.weights()
    pair = TrainerGroup(f"solver.{mode}.1", members, rendezvous.address, 60.0)
    on(client, members, slot.start_trainer, key, str(tiny_dir), sharded, 1.0, 6, 0, pair)
    for batch in batches:  # the first step's lr is 0 (warmup): the second moves the weights
        expected = reference_step(reference, batch)
        results = step(client, members, key, batch, pair)
    first = on(client, members, slot.weights, key)

    assert [r.policy_version for r in results] == [2, 2] and not any(r.skipped for r in results)
    assert sorted(i for r in results for i in r.consumed_ids) == sorted(expected.consumed_ids)
    assert results[0].metrics["micro_batches"] == expected.metrics["micro_batches"] == 4
    assert results[0].num_tokens == expected.num_tokens
    assert results[0].metrics["loss/policy"] == pytest.approx(expected.metrics["loss/policy"], rel=1e-6)
    assert results[0].metrics["grad_norm"] == pytest.approx(expected.metrics["grad_norm"], rel=1e-5)
    assert first[1] == {}  # gathered onto rank 0
    assert weight_drift({"s": first[0]}, {"s": reference.weights()}, {"s": start}) < 1e-3
    whole = sharding.local_bytes(start)
    for weights_bytes, moment_bytes in on(client, members, held_bytes, key):  # each rank: about half
        assert weights_bytes <= 0.55 * whole if mode == "full" else weights_bytes == whole  # ZeRO-1: whole
        assert 0.4 * 2 * whole <= moment_bytes <= 0.6 * 2 * whole
    parked = on(client, members, state, key)[0]

    # parked by both ranks, resumed by one (a world of 1), trained, parked again and resumed by two
    on(client, members, slot.park, key, str(tmp_path / "k2"), {})
    alone = TrainerGroup(f"solver.{mode}.2", members[:1], rendezvous.address, 60.0)
    on(client, members[:1], slot.resume, key, str(tiny_dir), sharded, 1.0, 6, str(tmp_path / "k2"), 2, None, alone)
    assert on(client, members[:1], slot.weights, key)[0].keys() == first[0].keys()
    assert all(torch.equal(a, b) for a, b in zip(on(client, members[:1], slot.weights, key)[0].values(),
                                                 first[0].values(), strict=True))
    resumed = on(client, members[:1], state, key)[0]
    assert resumed.keys() == parked.keys() and all(torch.equal(resumed[k], parked[k]) for k in parked)
    step(client, members[:1], key, batches[0], alone)
    reference_step(reference, batches[0])
    second = on(client, members[:1], slot.weights, key)[0]
    assert weight_drift({"s": second}, {"s": reference.weights()}, {"s": start}) < 1e-3

    on(client, members[:1], slot.park, key, str(tmp_path / "k1"), {})
    again = TrainerGroup(f"solver.{mode}.3", members, rendezvous.address, 60.0)
    on(client, members, slot.resume, key, str(tiny_dir), sharded, 1.0, 6, str(tmp_path / "k1"), 3, None, again)
    assert on(client, members, version, key) == [3, 3]
    assert all(torch.equal(a, b) for a, b in zip(on(client, members, slot.weights, key)[0].values(),
                                                 second.values(), strict=True))


def count_gathers(on: bool) -> int:
    """Count this worker's gathers of an FSDP2 trainer's whole weights from now (``on``), or stop counting;
    returns how many were counted."""
    from flexmarl.training import trainer as module
    counted = getattr(module, "counted_gathers", None)
    if on and counted is None:
        module.counted_gathers = counted = []
        real = module.full_weights
        module.full_weights = lambda model: counted.append(1) or real(model)
        module.real_full_weights = real
    elif not on and counted is not None:
        module.full_weights = module.real_full_weights
        del module.counted_gathers, module.real_full_weights
    return len(counted or ())


def test_an_fsdp2_trainer_s_weights_are_gathered_once_per_version_for_its_syncs_and_its_snapshot(
        tiny_dir, workers, tmp_path) -> None:
    """The step gathers the whole weights onto the home; the snapshot of that version writes them without a
    second gather of 0.5 GB (SmolLM2), and a sync reads the same tensors; the next step gathers again."""
    from flexmarl.training.snapshots import load_weights, save_snapshot, snapshot_uri

    client, members, rendezvous = workers
    key = EngineKey("run-gathers", "solver")
    pair = TrainerGroup("solver.gathers.1", members, rendezvous.address, 60.0)
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -1.5, 1.5, 1.0])
    on(client, members, slot.start_trainer, key, str(tiny_dir), CONFIG.model_copy(update={"sharding": "full"}),
       1.0, 6, 0, pair)
    try:
        on(client, members, count_gathers, True)
        for version in (1, 2):
            step(client, members, key, batch, pair)
            on(client, members, save_snapshot, key, str(tmp_path), version, {})
            synced = on(client, members[:1], slot.weights, key)[0]
            assert on(client, members, count_gathers, True) == [version, version]
            written = load_weights(snapshot_uri(str(tmp_path), "solver", version))
            assert written.keys() == synced.keys() and all(torch.equal(written[k], synced[k]) for k in synced)
    finally:
        on(client, members, count_gathers, False)
        on(client, members, slot.drop_trainer, key)


@pytest.mark.parametrize(("mode", "share", "total"), [("full", 1 / 2, 1), ("optimizer", 1 / 3 + 1 / 3, 4 / 3)])
def test_the_swap_benchmark_reports_a_sharded_state_per_rank_and_its_resharding_bit_exact(mode, share, total,
                                                                                          model_cache) -> None:
    """Each rank holds half the state under FSDP2; under ZeRO-1 the whole weights (a third of the state) and
    half the moments, so the ranks hold the weights twice and the moments once."""
    from flexmarl.bench.swap_bench import SHARDED_LEGS, bench_sharded

    report = bench_sharded("tiny", 2, log=lambda _: None, sharding=mode)
    whole = report["whole_state_bytes"]
    assert report["bit_exact"] and report["ranks"] == 2 and len(report["rank_state_bytes"]) == 2
    assert all((share - 0.05) * whole <= b <= (share + 0.05) * whole for b in report["rank_state_bytes"])
    assert sum(report["rank_state_bytes"]) == pytest.approx(total * whole, rel=0.03)
    for leg in SHARDED_LEGS:
        assert report[f"{leg}_s"] > 0 and report[f"{leg}_gb_per_s"] > 0
