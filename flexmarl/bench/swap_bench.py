"""`flexmarl bench swap`: how fast an agent's whole training state moves, and whether it comes back exact.

For each model: build a trainer (with an lr warm-up, so that a scheduler state exists too), take one
optimizer step (so that the Adam moments exist), then time each leg through the one location API,
``TrainingState.to``: device -> host, host -> device, device -> a directory, the directory -> a fresh trainer,
and the same through an fsspec object store (``memory://`` by default: serialisation and copies without a
network). Every tensor, the version, the scheduler and the RNG state are then compared bit by bit.

On a CUDA machine host copies go through pinned buffers, and ``to_host_pageable_s`` adds the same copy
through pageable memory for comparison. Without a GPU, "device" and "host" are the same memory and the first
two figures are plain copies. Each model is measured twice: an agent that trains the whole model, and one that
trains a LoRA adapter on it (only the adapter's tensors and their Adam moments move).

With ``ranks``, a third time: the state sharded over that many worker processes (``bench_sharded``): each rank's
bytes and peak memory against one rank's, and the distributed checkpoint's park, resume, and resharding legs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import fsspec
import torch

from flexmarl.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from flexmarl.bench.timing import timed
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.cluster.worker_state import EngineKey, register
from flexmarl.models.loading import meta_model, resolve_model
from flexmarl.training import slot
from flexmarl.training.sharding import full_state, held_bytes, local_bytes
from flexmarl.training.config import TrainerConfig
from flexmarl.training.group import Rendezvous, TrainerGroup
from flexmarl.training.state import DEVICE, HOST, HostCopy, TrainingState
from flexmarl.training.trainer import AgentTrainer, TrainBatch

LEGS = ("to_host", "to_device", "to_disk", "from_disk", "to_object_store", "from_object_store")


def _pageable_copy(trainer: AgentTrainer) -> list[torch.Tensor]:
    tensors = [p.data for p in trainer.model.parameters()]
    tensors += [t for per_param in trainer.optimizer.state.values() for t in per_param.values()
                if torch.is_tensor(t) and t.dim() > 0]
    return [t.to("cpu") for t in tensors]


def same_state(a: HostCopy, b: HostCopy) -> bool:
    """Bit-exact equality of two captured states: every tensor, the version, scheduler and RNG."""
    return (
        a.weights.keys() == b.weights.keys() and a.optimizer.keys() == b.optimizer.keys()
        and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
        and all(torch.equal(a.optimizer[k], b.optimizer[k]) for k in a.optimizer)
        and a.meta == b.meta
    )


def bench_one(model: str, object_store: str = "memory://flexmarl-bench-swap",
              adapter: AdapterConfig | None = None) -> dict:
    """One model's legs; with ``adapter``, the state of an agent that trains that LoRA adapter on the model."""
    model_dir = resolve_model(model)
    config = TrainerConfig(lr=1e-5, lr_warmup_steps=2, adapter=adapter)

    def new_trainer() -> AgentTrainer:
        return AgentTrainer("bench", model_dir, config, temperature=1.0)

    trainer = new_trainer()
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 24), generator=g).tolist()
    trainer.train_step(TrainBatch(["a", "b"], [i[:16] for i in ids], [i[16:] for i in ids],
                                  [[-1.0] * 8] * 2, [1.0, -1.0], [0, 0]))
    before = HostCopy.capture(trainer)
    result: dict = {"state_bytes": before.nbytes}
    if torch.cuda.is_available():  # the device -> host copy without pinned buffers, for comparison
        result["to_host_pageable_s"] = timed(lambda: _pageable_copy(trainer))
        result["to_host_pageable_gb_per_s"] = result["state_bytes"] / result["to_host_pageable_s"] / 1e9
    state = TrainingState.of(trainer)
    result["to_host_s"] = timed(lambda: state.to(HOST))
    result["to_device_s"] = timed(lambda: state.to(DEVICE))
    after_moves = HostCopy.capture(trainer)
    with tempfile.TemporaryDirectory() as tmp:
        result["to_disk_s"] = timed(lambda: state.to(tmp))
        from_disk = new_trainer()
        result["from_disk_s"] = timed(lambda: state.to(DEVICE, trainer=from_disk))
    restored_disk = HostCopy.capture(from_disk)
    result["to_object_store_s"] = timed(lambda: state.to(object_store))
    from_store = new_trainer()
    result["from_object_store_s"] = timed(lambda: state.to(DEVICE, trainer=from_store))
    restored_store = HostCopy.capture(from_store)
    fs, root = fsspec.core.url_to_fs(object_store)
    fs.rm(root, recursive=True)
    result["bit_exact"] = all(same_state(before, x) for x in (after_moves, restored_disk, restored_store))
    for leg in LEGS:
        result[f"{leg}_gb_per_s"] = result["state_bytes"] / result[f"{leg}_s"] / 1e9
    result["object_store"] = object_store.split("://", 1)[0] if "://" in object_store else "file"
    result["pinned"] = torch.cuda.is_available()  # host copies through pinned buffers
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return result


def bench_swap(models: Sequence[str], log: Callable[[str], None] = print, adapter_rank: int = 8,
               ranks: int = 0, sharding: str = "full") -> dict:
    """Each model's full training state (``models``) and, unless ``adapter_rank`` is 0, the state of a LoRA
    adapter agent of that rank on it (``adapters``): what a slot moves for each kind of agent. With ``ranks``,
    also the state sharded over that many worker processes as ``sharding`` says (``sharded``, ``bench_sharded``)."""
    report: dict = {"models": {}, "adapters": {}, "sharded": {}}
    for model in models:
        log(f"swap benchmark: {model}")
        report["models"][model] = bench_one(model)
        if adapter_rank:
            log(f"swap benchmark: {model}, LoRA adapter r={adapter_rank}")
            adapter = AdapterConfig(r=adapter_rank, alpha=2 * adapter_rank)
            report["adapters"][model] = {"r": adapter_rank, **bench_one(model, adapter=adapter)}
        if ranks:
            report["sharded"][model] = bench_sharded(model, ranks, log, sharding)
    report["bit_exact"] = all(m["bit_exact"] for kind in ("models", "adapters", "sharded")
                              for m in report[kind].values())
    report["device"] = next(iter(report["models"].values()))["device"] if report["models"] else "cpu"
    return report


SHARDED_LEGS = ("park", "resume", "reshard_to_one", "reshard_back")


def _train_once(key: EngineKey, batch: TrainBatch) -> int:
    """One micro-batch and the optimizer step of this rank's trainer (so that the Adam moments exist)."""
    held = slot.trainer(key)
    held.accumulate(batch)
    held.finish_step()  # a sharded trainer's: summed over its world
    return peak_rss_bytes()


def _start(key: EngineKey, *args) -> int:
    """Build this rank's trainer; returns what the process held before (its peak counted from then)."""
    before = rss_bytes()
    reset_peak_rss()
    slot.start_trainer(key, *args)
    return before


def _held(key: EngineKey) -> tuple[int, dict[str, torch.Tensor]]:
    """This rank's bytes of the state, and the whole state on rank 0 (every rank calls it)."""
    held = slot.trainer(key)
    return (held_bytes(held.policy_state(), held.optimizer),
            full_state(held.model, held.optimizer))


def bench_sharded(model: str, ranks: int = 2, log: Callable[[str], None] = print, sharding: str = "full") -> dict:
    """A sharded agent's state (``training.sharding``: 'full' or 'optimizer') over ``ranks`` worker processes: each
    rank's bytes and peak memory against one rank holding it all, and the time to park it, resume it over the
    same ranks, over one (resharding) and back, each round trip compared bit by bit.

    Two fresh LocalClusters: ``ranks`` workers, and one worker for the single-rank figures.
    """
    from distributed import Client, LocalCluster

    from flexmarl.cluster.local import submit_on, worker_env

    model_dir = str(resolve_model(model))
    config = TrainerConfig(lr=1e-5, lr_warmup_steps=2, sharding=sharding)
    key = EngineKey("bench-shards", "bench")
    vocab = _vocabulary(model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * ranks, 24), generator=g).tolist()
    batch = TrainBatch([f"s{i}" for i in range(len(ids))], [i[:16] for i in ids], [i[16:] for i in ids],
                       [[-1.0] * 8] * len(ids), [1.0, -1.0] * ranks, [0] * len(ids))
    result: dict = {"ranks": ranks, "sharding": sharding}

    def cluster(n: int):
        return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                            env=worker_env())

    with tempfile.TemporaryDirectory() as tmp, cluster(ranks) as many, Client(many) as client:
        register(client)
        members = tuple(sorted(client.scheduler_info(n_workers=-1)["workers"]))
        rendezvous = Rendezvous(many.scheduler_address)

        def on(who: tuple[str, ...], c: Client, fn, *args) -> list:
            return c.gather([submit_on(c, w, fn, *args) for w in who])

        def group(name: str, who: tuple[str, ...]) -> TrainerGroup:
            return TrainerGroup(name, who, rendezvous.address, 600.0)

        log(f"sharded swap benchmark: {model} over {ranks} ranks ({sharding})")
        base = on(members, client, _start, key, model_dir, config, 1.0, 8, 0, group("b.1", members))
        peaks = on(members, client, _train_once, key, batch)
        held = on(members, client, _held, key)
        trained = held[0][1]
        result["whole_state_bytes"] = local_bytes(trained)
        result["rank_state_bytes"] = [h[0] for h in held]
        result["rank_peak_rss_over_start_bytes"] = [p - b for p, b in zip(peaks, base, strict=True)]
        result["park_s"] = timed(lambda: on(members, client, slot.park, key, f"{tmp}/k", {}))
        result["resume_s"] = timed(lambda: on(members, client, slot.resume, key, model_dir, config, 1.0, 8,
                                              f"{tmp}/k", 1, None, group("b.2", members)))
        exact = [_same(on(members, client, _held, key)[0][1], trained)]
        with cluster(1) as one, Client(one) as single:
            register(single)
            alone = tuple(single.scheduler_info(n_workers=-1)["workers"])
            result["reshard_to_one_s"] = timed(lambda: on(alone, single, slot.resume, key, model_dir, config, 1.0, 8,
                                                          f"{tmp}/k", 1, None, group("b.3", alone)))
            exact.append(_same(on(alone, single, _held, key)[0][1], trained))
            on(alone, single, slot.park, key, f"{tmp}/one", {})
            on(alone, single, slot.drop_trainer, key)
            base_one = on(alone, single, _start, key, model_dir, config, 1.0, 8, 0, group("b.4", alone))[0]
            result["one_rank_peak_rss_over_start_bytes"] = on(alone, single, _train_once, key, batch)[0] - base_one
        result["reshard_back_s"] = timed(lambda: on(members, client, slot.resume, key, model_dir, config, 1.0, 8,
                                                    f"{tmp}/one", 1, None, group("b.5", members)))
        exact.append(_same(on(members, client, _held, key)[0][1], trained))
    result["bit_exact"] = all(exact)
    for leg in SHARDED_LEGS:
        result[f"{leg}_gb_per_s"] = result["whole_state_bytes"] / result[f"{leg}_s"] / 1e9
    return result


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _vocabulary(model_dir: str) -> int:
    return meta_model(Path(model_dir)).get_input_embeddings().weight.shape[0]
