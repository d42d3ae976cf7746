"""A weight sync of SmolLM2-135M between a trainer and a rollout replica on one CPU worker: through a host copy
of the trainer's weights (``trainer.weights()``, what a sync fetched before 2026-12-07) against in place (the
trainer's tensors as they are, ``AgentTrainer.weights_in_place``), interleaved, 7 rounds, one thread. Run from the project
root: `.venv/bin/python docs/results/inplace_sync_ab.py > docs/results/inplace_sync_ab.json`."""
import json
import statistics
import time

import torch

from flexmarl.models.loading import resolve_model
from flexmarl.rollout.backend import WeightUpdate
from flexmarl.rollout.hf_backend import HFBackend
from flexmarl.training.config import TrainerConfig
from flexmarl.training.trainer import AgentTrainer

if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir = str(resolve_model("smollm2-135m-instruct"))
    trainer = AgentTrainer("solver", model_dir, TrainerConfig(), temperature=1.0)
    backend = HFBackend(model_dir)
    seconds: dict[str, list[float]] = {"host_copy": [], "in_place": []}
    version = 0
    for _ in range(7):
        for mode in seconds:
            version += 1
            start = time.perf_counter()
            state = trainer.weights() if mode == "host_copy" else trainer.weights_in_place()
            backend.update_weights(WeightUpdate("solver", version, state))
            seconds[mode].append(time.perf_counter() - start)
    out = {"model": "smollm2-135m-instruct", "seconds": seconds}
    out["median_s"] = {m: statistics.median(s) for m, s in seconds.items()}
    out["range_s"] = {m: [min(s), max(s)] for m, s in seconds.items()}
    print(json.dumps(out, indent=1))
