"""A weight sync between a trainer and a replica on the same worker (``replica.load_trainer_weights``): the replica
copies the trainer's tensors where they are, takes the version exactly, and keeps it while the trainer moves on."""

from __future__ import annotations

import pytest
import torch
from distributed import Client, LocalCluster

from flexmarl.cluster.local import submit_on
from flexmarl.cluster.worker_state import EngineKey, register, release
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.rollout import replica
from flexmarl.rollout.adapter_backend import AdapterBackend
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.trainer import TrainBatch

from ..training.test_trainer import make_batch

pytestmark = pytest.mark.cluster
LORA = AdapterConfig(r=4, alpha=8)


def step(key: EngineKey, batch: TrainBatch) -> int:
    held = slot.trainer(key)
    held.accumulate(batch)
    return held.finish_step().policy_version


def replica_weights(key: EngineKey) -> dict[str, torch.Tensor]:
    backend = replica.replica(key)
    own = backend.host.state(backend.adapter) if isinstance(backend, AdapterBackend) else backend.model.state_dict()
    return {k: v.detach().clone() for k, v in own.items()}


def trainer_weights(key: EngineKey) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in slot.trainer(key).weights().items()}


@pytest.mark.parametrize("adapter", [None, LORA], ids=["model", "adapter"])
def test_a_replica_beside_its_trainer_takes_the_version_in_place_and_keeps_it_while_the_trainer_moves_on(
        tiny_dir, adapter) -> None:
    key = EngineKey("run-sync", "solver")
    config = TrainerConfig(lr=1e-2, adapter=adapter)
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5, -0.5])
    with (LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
          Client(cluster) as client):
        register(client)
        worker = next(iter(client.scheduler_info()["workers"]))

        def on(fn, *args):
            return submit_on(client, worker, fn, *args).result()

        on(replica.start_replica, key, str(tiny_dir), 0, None, adapter)
        on(slot.start_trainer, key, str(tiny_dir), config, 1.0, 6, 0)
        start = on(replica_weights, key)
        assert on(step, key, batch) == 1
        v1 = on(trainer_weights, key)
        assert not all(torch.equal(v1[k], start[k]) for k in v1)  # the step moved the weights

        loaded = on(replica.load_trainer_weights, key, 1)
        assert loaded.version == 1 and loaded.nbytes == sum(t.numel() * t.element_size() for t in v1.values())
        synced = on(replica_weights, key)
        assert synced.keys() == v1.keys() and all(torch.equal(synced[k], v1[k]) for k in v1)

        assert on(step, key, batch) == 2  # the trainer moves on: the replica keeps v1 (copied, not shared)
        assert all(torch.equal(on(replica_weights, key)[k], v1[k]) for k in v1)
        assert on(replica.load_trainer_weights, key, 1).nbytes == 0  # held already: nothing to do
        with pytest.raises(RuntimeError, match="is at v2, not v3"):
            on(replica.load_trainer_weights, key, 3)
        for kind in ("replica", "trainer"):
            client.run(release, f"{kind}:run-sync/")
