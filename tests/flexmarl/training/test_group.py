"""An agent's trainer over two Dask workers: a real gloo process group, micro-batches spread over its ranks."""

from __future__ import annotations

import pytest
import torch
from distributed import Client, LocalCluster

from flexmarl.cluster.local import submit_on
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import Rendezvous, TrainerGroup
from flexmarl.training.trainer import AgentTrainer, TrainBatch

from .test_trainer import make_batch

pytestmark = pytest.mark.cluster  # a threads LocalCluster each

KEY = EngineKey("run-g", "solver")
CONFIG = TrainerConfig(lr=1e-3, lr_warmup_steps=0, micro_batch_size=2, loss_type="dapo")


def accumulate(key: EngineKey, batch: TrainBatch, picks: list[tuple[int, int]]) -> int:
    trainer = slot.trainer(key)
    for start, stop in picks:
        trainer.accumulate(batch.slice(start, stop))
    return len(picks)


def weights(key: EngineKey) -> dict[str, torch.Tensor]:
    return slot.trainer(key).weights()


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=rtol, atol=1e-7) for k in a)


@pytest.mark.parametrize("split", ["interleaved", "one_rank_idle"])
def test_a_step_spread_over_two_ranks_equals_the_single_slot_step(tiny_dir, split) -> None:
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -1.5, 1.5])
    micro = [(i, i + 2) for i in range(0, len(batch), 2)]
    reference = AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0, max_new_tokens=6)
    expected = reference.train_step(batch)

    picks = {"interleaved": (micro[0::2], micro[1::2]), "one_rank_idle": (micro, [])}[split]
    rendezvous = Rendezvous("tcp://127.0.0.1:1")
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
          Client(cluster) as client):
        register(client)
        members = tuple(sorted(client.scheduler_info(n_workers=-1)["workers"]))
        for worker, mine in zip(members, picks, strict=True):
            submit_on(client, worker, slot.start_trainer, KEY, str(tiny_dir), CONFIG, 1.0, 6, 0).result()
            submit_on(client, worker, accumulate, KEY, batch, mine).result()
        group = TrainerGroup("solver.1", members, rendezvous.address, 60.0)
        results = client.gather([submit_on(client, w, slot.finish_step, KEY, group) for w in members])
        ranks = [submit_on(client, w, weights, KEY).result() for w in members]

    assert all(r.policy_version == 1 and not r.skipped for r in results)
    assert sorted(sum((r.consumed_ids for r in results), [])) == sorted(expected.consumed_ids)
    assert {r.num_tokens for r in results} == {expected.num_tokens}  # the group's, on every rank
    assert results[0].metrics["micro_batches"] == expected.metrics["micro_batches"] == 4
    assert results[0].metrics["loss/policy"] == pytest.approx(expected.metrics["loss/policy"], rel=1e-9)
    assert results[0].metrics["grad_norm"] == pytest.approx(expected.metrics["grad_norm"], rel=1e-6)
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # every rank took the same step
    assert close(ranks[0], reference.weights())
    assert not close(ranks[0], AgentTrainer("solver", tiny_dir, CONFIG, temperature=1.0).weights())  # it moved
