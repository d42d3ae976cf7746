"""Slot functions on a real Dask cluster: an agent's state parked by one worker, read ahead by another."""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

from flexmarl.bench.swap_bench import same_state
from flexmarl.cluster.local import submit_on
from flexmarl.cluster.worker_state import EngineKey, register, release, timed_call
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.state import HostCopy

from .test_trainer import make_batch

pytestmark = pytest.mark.cluster  # a threads LocalCluster each

KEY = EngineKey("run-x", "solver")
CONFIG = TrainerConfig(lr=1e-3, lr_warmup_steps=2)


def train_and_capture(key: EngineKey, batch) -> HostCopy:
    trainer = slot.trainer(key)
    trainer.train_step(batch)
    return HostCopy.capture(trainer)


def capture(key: EngineKey) -> HostCopy:
    return HostCopy.capture(slot.trainer(key))


def test_a_state_prefetched_by_another_worker_resumes_without_a_read_and_bit_exact(tiny_dir, tmp_path) -> None:
    uri = f"memory://slot-test/{tmp_path.name}/solver"  # workers are threads of this process: they share memory://
    batch = make_batch(tiny_dir, [1.0, -1.0, 0.5])
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
          Client(cluster) as client):
        register(client)
        a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
        submit_on(client, a, slot.start_trainer, KEY, str(tiny_dir), CONFIG, 1.0, 6, 0).result()
        before = submit_on(client, a, train_and_capture, KEY, batch).result()

        parked = submit_on(client, a, slot.park, KEY, uri, {})
        submit_on(client, b, slot.prefetch, KEY, uri, {}, parked).result()
        moved = submit_on(client, b, slot.resume, KEY, str(tiny_dir), CONFIG, 1.0, 6, uri, 1).result()
        assert moved.worker == b and moved.prefetch is not None  # taken from the copy read ahead
        assert moved.prefetch.end >= moved.prefetch.start
        assert same_state(before, submit_on(client, b, capture, KEY).result())
        assert submit_on(client, a, slot.drop_trainer, KEY).result()  # the old worker lets go of it
        with pytest.raises(RuntimeError, match="no trainer 'run-x/solver' on worker"):
            submit_on(client, a, capture, KEY).result()

        # without a prefetch, resume reads the state itself; a state at another version is refused
        submit_on(client, b, slot.park, KEY, uri, {}).result()
        again = submit_on(client, a, slot.resume, KEY, str(tiny_dir), CONFIG, 1.0, 6, uri, 1).result()
        assert again.worker == a and again.prefetch is None and again.load_s > 0
        assert same_state(before, submit_on(client, a, capture, KEY).result())
        with pytest.raises(RuntimeError, match=r"the state of 'solver' at .* is at v1, expected v2"):
            submit_on(client, b, slot.resume, KEY, str(tiny_dir), CONFIG, 1.0, 6, uri, 2).result()


def test_a_task_that_reaches_a_worker_after_its_run_released_the_engines_ends_quietly(tiny_dir) -> None:
    """A stopped run cancels its tasks and releases its engines, but Dask cannot stop a task already running:
    such a task must not fail with "no trainer" (a traceback in the worker's log after a clean Ctrl-C)."""
    with (LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
          Client(cluster) as client):
        register(client)
        (a,) = client.scheduler_info(n_workers=-1)["workers"]
        with pytest.raises(RuntimeError, match="no trainer 'run-x/other' on worker"):  # never started: an error
            submit_on(client, a, timed_call, capture, EngineKey("run-x", "other")).result()
        submit_on(client, a, slot.start_trainer, KEY, str(tiny_dir), CONFIG, 1.0, 6, 0).result()
        assert client.run(release, "trainer:run-x/") == {a: 1}
        timed = submit_on(client, a, timed_call, capture, KEY).result()
        assert timed.value is None and timed.worker == a
        submit_on(client, a, slot.start_trainer, KEY, str(tiny_dir), CONFIG, 1.0, 6, 0).result()  # the run resumed
        assert submit_on(client, a, timed_call, capture, KEY).result().value is not None
