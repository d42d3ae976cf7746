# One-off A/B behind prefix_prefill_ab.json: needs ca3047b's hf_backend.py and trainer.py saved as hf_old.py and
# trainer_old.py in /tmp/probe (git show ca3047b:flexmarl/rollout/hf_backend.py > /tmp/probe/hf_old.py, etc.).
"""A/B, interleaved: the HF backend and the trainer's scoring before (ca3047b) and after shared-prefix prefill,
on SmolLM2 with the default preset's prompts. Solver: GRPO groups of 8 (12 new tokens). Verifier: 16
distinct prompts quoting different answers (3 new tokens). Training: forward+backward of a micro-batch of 16."""
import json, statistics, sys, time
sys.path.insert(0, "/tmp/probe")
import torch
import trainer_old
from hf_old import HFBackend as Old
from flexmarl.rollout.hf_backend import HFBackend as New
from flexmarl.training import trainer as new
from flexmarl.training.config import TrainerConfig
from flexmarl.rollout.backend import GenerationRequest
from flexmarl.models.loading import resolve_model, load_tokenizer
from flexmarl.config import load_config
from flexmarl.rollout.episodes import render_prompt
torch.set_num_threads(1)
model = resolve_model("smollm2-135m-instruct")
tok = load_tokenizer(model)
cfg = load_config(preset="default")
sums = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 4, 6), (3, 5, 7), (9, 1, 2), (6, 6, 1), (8, 2, 5)]
qs = [f"State the final answer to the following arithmetic problem: {a} + {b} - {c} =" for a, b, c in sums]
solver = [render_prompt(tok, cfg.agents["solver"].prompt, None, {"question": q}) for q in qs]
answers = ["{} + {} - {} = {}".format(a, b, c, a + b - c + k) for (a, b, c) in sums for k in (0, 1)]
verifier = [render_prompt(tok, cfg.agents["verifier"].prompt, None, {"question": qs[i // 2], "solver": answers[i]})
            for i in range(16)]
def grouped(n, tokens):
    return [GenerationRequest(f"p{p}s{s}", solver[p], tokens, 0.7, seed=p * 100 + s) for p in range(n) for s in range(8)]
def distinct(tokens):
    return [GenerationRequest(f"v{i}", verifier[i], tokens, 1.0, seed=i) for i in range(16)]
cases = {"solver 2x8, 12 tokens": lambda: grouped(2, 12), "solver 8x8, 12 tokens": lambda: grouped(8, 12),
         "verifier 16, 3 tokens": lambda: distinct(3)}
backends = {"before": Old(model), "after": New(model)}
trainer = new.AgentTrainer("a", model, TrainerConfig(lr=1e-5), temperature=0.7)
scorers = {"before": trainer_old.response_logprobs, "after": new.response_logprobs}
train_batches = {}
for name in ("solver 2x8, 12 tokens", "verifier 16, 3 tokens"):
    reqs = cases[name]()
    res = backends["after"].generate(reqs)
    train_batches[name] = new.TrainBatch([r.request_id for r in res], [q.prompt_ids for q in reqs],
                                         [r.response_ids for r in res], [r.logprobs for r in res], [1.0, -1.0] * 8, [0] * 16)
rollout = {c: {k: [] for k in backends} for c in cases}
train = {c: {k: [] for k in scorers} for c in train_batches}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for case, make in cases.items():
        for name, b in backends.items():
            t0 = time.perf_counter(); res = b.generate(make()); rollout[case][name].append(time.perf_counter() - t0)
    for case, batch in train_batches.items():
        for name, fn in scorers.items():
            trainer.model.zero_grad()
            t0 = time.perf_counter()
            logp, mask = fn(trainer.model, batch, 0.7, torch.device("cpu"))
            (logp * mask).sum().backward()
            train[case][name].append(time.perf_counter() - t0)
def summary(d):
    med = {k: statistics.median(v) for k, v in d.items()}
    return {"seconds_median": {k: round(v, 3) for k, v in med.items()},
            "spread": {k: [round(min(v), 3), round(max(v), 3)] for k, v in d.items()},
            "speedup": round(med["before"] / med["after"], 2)}
print(json.dumps({"model": "smollm2-135m-instruct", "torch_threads": 1, "repeats": len(next(iter(rollout.values()))["before"]),
                  "solver_prompt_tokens": len(solver[0]), "verifier_prompt_tokens": len(verifier[0]),
                  "rollout": {c: summary(d) for c, d in rollout.items()},
                  "train_forward_backward": {c: summary(d) for c, d in train.items()}}, indent=1))
