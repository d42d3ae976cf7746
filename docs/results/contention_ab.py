# One-off A/B behind contention_ab.json: `OMP_NUM_THREADS=1 .venv/bin/python docs/results/contention_ab.py [rounds]`
# on a machine with nothing else running.
"""How two single-threaded workers on this 2-core machine slow each other, by what each runs.

Two processes, as a run's two Dask workers are, each load SmolLM2-135M once. Each condition runs a timed window
of work in process A alone, or in A and B at once, and reports each process's rate: generated tokens/s for
decoding (the HF backend on the fan-out solver's batch, 12 requests of 3 GRPO groups, 32 new tokens) and
trained tokens/s for training (forward and backward of a micro-batch of 12 sequences of 96 tokens). The
conditions are interleaved and repeated, and each rate is the median over rounds with [min, max].
"""
import json
import multiprocessing as mp
import statistics
import sys
import time

WINDOW_S = 20.0
MODEL = "smollm2-135m-instruct"
BATCH, GROUP, PROMPT, NEW = 12, 4, 48, 32
TRAIN_LEN = 96


def worker(conn) -> None:
    import torch

    from flexmarl.models.loading import load_model, resolve_model
    from flexmarl.rollout.backend import GenerationRequest
    from flexmarl.rollout.hf_backend import HFBackend

    torch.set_num_threads(1)
    model_dir = resolve_model(MODEL)
    backend = HFBackend(model_dir)
    trainee = load_model(model_dir).train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (BATCH // GROUP, PROMPT), generator=g).tolist()
    sequences = torch.randint(100, 40000, (BATCH, TRAIN_LEN), generator=g)
    n = 0

    def decode() -> int:
        nonlocal n
        n += 1
        requests = [GenerationRequest(f"r{n}_{i}", prompts[i // GROUP], NEW, 1.0, seed=n * BATCH + i)
                    for i in range(BATCH)]
        return sum(len(r.response_ids) for r in backend.generate(requests))

    def train() -> int:
        trainee.zero_grad()
        trainee(sequences, labels=sequences).loss.backward()
        return sequences.numel()

    conn.send("ready")
    while (msg := conn.recv()) is not None:
        kind, start_at = msg
        work = {"decode": decode, "train": train}[kind]
        while time.time() < start_at:
            time.sleep(0.001)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < WINDOW_S:
            done += work()
        conn.send(done / (time.perf_counter() - t0))


CONDITIONS = {  # name: (what A runs, what B runs or None)
    "decode alone": ("decode", None),
    "decode beside decode": ("decode", "decode"),
    "decode beside train": ("decode", "train"),
    "train alone": ("train", None),
    "train beside train": ("train", "train"),
}


def main(rounds: int) -> None:
    ctx = mp.get_context("spawn")
    pipes = []
    for _ in range(2):
        parent, child = ctx.Pipe()
        ctx.Process(target=worker, args=(child,), daemon=True).start()
        pipes.append(parent)
    for p in pipes:
        assert p.recv() == "ready"
    rates: dict[str, dict[str, list[float]]] = {c: {"A": [], "B": []} for c in CONDITIONS}
    for r in range(rounds):
        for name, (a, b) in CONDITIONS.items():
            start_at = time.time() + 0.5
            pipes[0].send((a, start_at))
            if b:
                pipes[1].send((b, start_at))
            rates[name]["A"].append(pipes[0].recv())
            if b:
                rates[name]["B"].append(pipes[1].recv())
            print(f"round {r + 1}, {name}: A {rates[name]['A'][-1]:.0f}/s"
                  + (f", B {rates[name]['B'][-1]:.0f}/s" if b else ""), flush=True)
    for p in pipes:
        p.send(None)
    med = lambda v: {"median": statistics.median(v), "min": min(v), "max": max(v)}  # noqa: E731
    out = {"model": MODEL, "window_s": WINDOW_S, "rounds": rounds,
           "decode": {"batch": BATCH, "group": GROUP, "prompt_len": PROMPT, "new_tokens": NEW},
           "train": {"batch": BATCH, "seq_len": TRAIN_LEN},
           "rates": {c: {k: med(v) for k, v in d.items() if v} for c, d in rates.items()}}
    alone = {k: statistics.median(rates[f"{k} alone"]["A"]) for k in ("decode", "train")}
    out["slowdown"] = {  # each process's rate over the same work alone
        "decode beside decode": statistics.median(rates["decode beside decode"]["A"]
                                                  + rates["decode beside decode"]["B"])
        / alone["decode"],
        "decode beside train": statistics.median(rates["decode beside train"]["A"]) / alone["decode"],
        "train beside decode": statistics.median(rates["decode beside train"]["B"]) / alone["train"],
        "train beside train": statistics.median(rates["train beside train"]["A"] + rates["train beside train"]["B"])
        / alone["train"],
    }
    print(json.dumps(out["slowdown"], indent=2))
    with open(__file__.replace(".py", ".json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
