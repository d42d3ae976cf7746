# One-off A/B behind decode_levers_ab.json: `OMP_NUM_THREADS=1 .venv/bin/python docs/results/decode_levers_ab.py`
# on a machine with nothing else running (about 9 minutes, 5 of them torch.compile's first call).
"""Do a preallocated KV cache or a compiled decode speed up the HF backend's decode loop on this CPU?

The HF backend's cache (transformers' DynamicCache) concatenates every layer's keys and values anew at each
step; ``prealloc`` gives each layer buffers with room for the answer and writes the new position in place.
``compiled`` runs the model through ``torch.compile(dynamic=True)`` (inductor, one thread). The three ways run
interleaved on the fan-out solver's shape (GRPO groups of 8 sharing a 48-token prompt, 32 new tokens) at batch
16 and 64; round 0 is a warm-up (and compile) and is not counted. All ways must sample identical tokens.
"""
import json
import statistics
import time

import torch
from transformers.cache_utils import DynamicLayer

from flexmarl.models import prefix
from flexmarl.models.loading import resolve_model
from flexmarl.rollout import hf_backend
from flexmarl.rollout.backend import GenerationRequest

ROUNDS, GROUP, PROMPT, NEW = 4, 8, 48, 32


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers with room for ``capacity`` positions."""

    def __init__(self, layer: DynamicLayer, capacity: int) -> None:
        super().__init__()
        k, v = layer.keys, layer.values
        self._k = k.new_empty((*k.shape[:2], capacity, k.shape[-1]))
        self._v = v.new_empty((*v.shape[:2], capacity, v.shape[-1]))
        self.length = k.shape[-2]
        self._k[:, :, : self.length], self._v[:, :, : self.length] = k, v
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]
        self.device, self.is_initialized = k.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self._k[:, :, self.length : end], self._v[:, :, self.length : end] = key_states, value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values


def prefill_preallocated(model, prompts, pad_id, device):
    pre = prefix.prefill(model, prompts, pad_id, device)
    pre.cache.layers = [PreallocatedLayer(layer, layer.keys.shape[-2] + NEW) for layer in pre.cache.layers]
    return pre


def main() -> None:
    torch.set_num_threads(1)
    backend = hf_backend.HFBackend(resolve_model("smollm2-135m-instruct"))
    eager = backend.model
    compiled = torch.compile(eager, dynamic=True)
    ways = {"dynamic": (eager, prefix.prefill), "prealloc": (eager, prefill_preallocated),
            "compiled": (compiled, prefix.prefill)}
    out = {"model": "smollm2-135m-instruct", "group": GROUP, "prompt_len": PROMPT, "new_tokens": NEW,
           "rounds_counted": ROUNDS - 1, "batches": {}}
    for batch in (16, 64):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(100, 40000, (batch // GROUP, PROMPT), generator=g).tolist()
        rates = {w: [] for w in ways}
        first_call_s = {}
        for r in range(ROUNDS):
            samples = {}
            for way, (model, fill) in ways.items():
                backend.model, hf_backend.prefill = model, fill
                requests = [GenerationRequest(f"r{r}_{i}", prompts[i // GROUP], NEW, 1.0, seed=r * batch + i)
                            for i in range(batch)]
                start = time.perf_counter()
                results = backend.generate(requests)
                seconds = time.perf_counter() - start
                samples[way] = [x.response_ids.tolist() for x in results]
                tokens = sum(len(x) for x in samples[way])
                if r == 0:
                    first_call_s[way] = seconds
                else:
                    rates[way].append(tokens / seconds)
                print(f"batch {batch} round {r} {way}: {seconds:.1f} s, {tokens / seconds:.1f} tokens/s", flush=True)
            assert samples["prealloc"] == samples["dynamic"] == samples["compiled"], "the ways sampled differently"
        base = statistics.median(rates["dynamic"])
        out["batches"][batch] = {
            w: {"tokens_per_s": {"median": statistics.median(v), "min": min(v), "max": max(v)},
                "vs_dynamic": statistics.median(v) / base, "first_call_s": first_call_s[w]}
            for w, v in rates.items()
        }
    out["identical_samples"] = True
    print(json.dumps(out, indent=2))
    with open(__file__.replace(".py", ".json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
