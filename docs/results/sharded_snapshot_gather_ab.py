"""A sharded (FSDP2) SmolLM2 trainer over two worker processes: seconds of one gather of its whole weights, and of
a snapshot written right after the step (the step's gather kept: what the snapshot does now) against one that
gathers the weights itself (what it did before 2026-12-07), interleaved, 4 rounds. Run from the project root:
`.venv/bin/python docs/results/sharded_snapshot_gather_ab.py > docs/results/sharded_snapshot_gather_ab.json`."""
import json
import statistics
import tempfile
import time

from distributed import Client, LocalCluster

from flexmarl.cluster.local import submit_on, worker_env
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.models.loading import resolve_model
from flexmarl.training import slot
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import Rendezvous, TrainerGroup
from flexmarl.training.sharding import full_weights
from flexmarl.training.snapshots import save_snapshot


def gather(key):
    t = time.perf_counter()
    full_weights(slot.trainer(key).model)
    return time.perf_counter() - t


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bump(key):  # a new version without a step: the next weights() gathers again
    slot.trainer(key).version += 1
    return slot.trainer(key).version


if __name__ == "__main__":
    model_dir = str(resolve_model("smollm2-135m-instruct"))
    key = EngineKey("gather-time", "solver")
    config = TrainerConfig(lr=1e-5, sharding="full")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      env=worker_env()) as cluster, Client(cluster) as c, tempfile.TemporaryDirectory() as tmp:
        register(c)
        members = tuple(sorted(c.scheduler_info(n_workers=-1)["workers"]))

        def on(fn, *args):
            return c.gather([submit_on(c, w, fn, *args) for w in members])

        rendezvous = Rendezvous(cluster.scheduler_address)  # hosts the store: kept alive
        pair = TrainerGroup("g.1", members, rendezvous.address, 120.0)
        on(slot.start_trainer, key, model_dir, config, 1.0, 8, 0, pair)
        gathers, cached, uncached = [], [], []
        for _ in range(4):
            gathers.append(max(on(gather, key)))  # the slower rank's
            v = on(bump, key)[0]
            on(slot.gather_weights, key)  # as the step's job does
            cached.append(timed(on, save_snapshot, key, tmp, v, {}))
            v = on(bump, key)[0]  # not gathered: the snapshot gathers, as before this change
            uncached.append(timed(on, save_snapshot, key, tmp, v, {}))
        out = {"gather_s": gathers, "snapshot_after_step_gather_s": cached, "snapshot_with_own_gather_s": uncached}
        out.update({f"median_{k}": statistics.median(v) for k, v in list(out.items())})
        print(json.dumps(out, indent=1))
