"""The pipeline on a real Dask LocalCluster and real Delta tables: every staleness-0 schedule trains the
same weights as the synchronous one, and the staleness bound holds when it is opted into."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from flexmarl.bench.chaos_bench import train
from flexmarl.bench.pipeline_bench import MODES, run_mode
from flexmarl.cluster.config import ClusterConfig
from flexmarl.cluster.local import open_cluster
from flexmarl.config import load_config
from flexmarl.reference import DRIFT_TOLERANCE, initial_weights, weight_drift
from flexmarl.workloads.registry import REWARDS
from storage.store import ExperienceStore

pytestmark = pytest.mark.cluster  # a real cluster and training runs: the module takes a minute or more

SMALL = ["run.steps=2", "run.queries_per_step=4", "run.group_size=2", "training.micro_batch_size=4"]


@pytest.fixture(scope="module")
def address():
    with open_cluster(ClusterConfig(n_workers=2)) as addr:
        yield addr


def run(mode: str, tmp_path: Path, address: str, workload: str = "fan_out"):
    cfg = load_config(preset=workload, overrides=[*SMALL, *MODES[mode]])
    result, weights = run_mode(cfg, tmp_path / mode, address)
    return cfg, result, weights, ExperienceStore(tmp_path / mode / "store")


def drift(a: dict, b: dict, cfg) -> float:
    """``b``'s distance from ``a`` as a share of ``a``'s move from the starting weights (``weight_drift``)."""
    return weight_drift(a, b, initial_weights(cfg))


def test_staleness_zero_schedules_train_the_sync_weights(tmp_path: Path, address: str) -> None:
    cfg, sync, w_sync, store_sync = run("sync", tmp_path, address)
    for mode in ("flexmarl", "no-pipeline"):
        _, result, weights, store = run(mode, tmp_path, address)
        assert drift(w_sync, weights, cfg) <= DRIFT_TOLERANCE, mode
        for agent in cfg.agents:
            a = store_sync.read_samples(agent, columns=["sample_id", "response_ids", "policy_version"])
            b = store.read_samples(agent, columns=["sample_id", "response_ids", "policy_version"])
            assert a.to_pylist() == b.to_pylist(), f"{mode}: {agent} sampled differently"
        assert {u.agent for u in result.updates} == set(cfg.agents)
        assert len(result.updates) == 2 * len(cfg.agents)
    # the weights moved: the test would pass trivially if nothing trained
    assert any(float(v.abs().sum()) > 0 for v in w_sync["solver"].values())


def test_staleness_one_is_bounded_and_corrected(tmp_path: Path, address: str) -> None:
    cfg, result, _, store = run("stale1", tmp_path, address)
    updates = store.read("updates")
    for agent in cfg.agents:
        samples = store.read_samples(agent, columns=["sample_id", "policy_version", "step"])
        version_of = dict(zip(samples["sample_id"].to_pylist(), samples["policy_version"].to_pylist()))
        mine = updates.filter(pc.field("agent") == agent)
        assert sorted(mine["policy_version"].to_pylist()) == [1, 2]
        for new_version, consumed in zip(mine["policy_version"].to_pylist(), mine["consumed_ids"].to_pylist()):
            lag = [new_version - 1 - version_of[sid] for sid in consumed]
            assert consumed and all(0 <= x <= 1 for x in lag), (agent, new_version, lag)


def test_a_resource_no_worker_offers_is_a_clear_error(address: str, tmp_path: Path) -> None:
    from flexmarl.cluster.local import ClusterError

    cfg = load_config(preset="tiny", overrides=[*SMALL, "cluster.train_resource=GPU"])
    with pytest.raises(ClusterError, match="no Dask worker offers resource 'GPU' for training"):
        run_mode(cfg, tmp_path / "gpu", address)


def test_agent_wise_advantages_and_kl_keep_the_pipeline_equal_to_sync(tmp_path: Path, address: str) -> None:
    extra = ["agents.solver.training={advantage: agent, kl_coef: 0.05}", "training.loss_type=dr_grpo"]
    weights = {}
    for mode in ("sync", "flexmarl"):
        cfg = load_config(preset="tiny", overrides=[*SMALL, *MODES[mode], *extra])
        _, weights[mode] = run_mode(cfg, tmp_path / mode, address)
    assert drift(weights["sync"], weights["flexmarl"], cfg) <= DRIFT_TOLERANCE


def test_agents_sharing_one_training_slot_train_the_same_weights(tmp_path: Path, address: str) -> None:
    weights, results = {}, {}
    for slots in ("null", "1"):
        cfg = load_config(preset="fan_out", overrides=[*SMALL, f"training.slots={slots}"])
        results[slots], weights[slots] = run_mode(cfg, tmp_path / f"slots-{slots}", address)
        trainers = {s.worker for s in results[slots].spans if s.kind == "train"}
        assert len(trainers) == (1 if slots == "1" else 2)  # three agents on one slot, or spread over two
    assert drift(weights["null"], weights["1"], cfg) <= DRIFT_TOLERANCE
    assert not results["1"].state_moves  # one slot holds every state: nothing moves


def test_a_weight_sync_that_hangs_fails_fast_naming_agent_replica_and_version(tmp_path: Path, monkeypatch) -> None:
    import time as _time

    from flexmarl.rollout import replica
    from flexmarl.rollout.backend import WeightSyncError

    release, hang_over = tmp_path / "release", tmp_path / "hang-over"  # files, not Events: the function must pickle

    def hanging_load_weights(key, version, state):  # fault injection: a replica that does not answer until released
        start = _time.monotonic()
        while not release.exists() and _time.monotonic() - start < 120:  # the bound: should the test never release
            _time.sleep(0.05)
        hang_over.touch()

    # an in-process (threads) cluster, so that the patched function is what the workers run
    monkeypatch.setattr(replica, "load_weights", hanging_load_weights)
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        from flexmarl.orchestrator.records import AgentFailed
        from flexmarl.orchestrator.runtime import RunContext, Runtime
        from flexmarl.run.prepare import prepare_run

        cfg = load_config(preset="tiny", overrides=[*SMALL, "rollout.sync_timeout_s=2"])
        run_id, store_uri = prepare_run(cfg, tmp_path / "hang")
        runtime = Runtime(RunContext(run_id, str(tmp_path / "hang"), store_uri, cluster.scheduler_address), cfg)
        events = []
        try:
            runtime.start_engines()
            hung = r"weight sync of agent '(solver|verifier)' to v1 on replica \S+ did not finish within 2s"
            with pytest.raises(WeightSyncError, match=hung) as err:
                runtime.run(on_event=events.append)
            assert not hang_over.exists()  # it failed at its timeout, while the replica still hung
        finally:
            release.touch()  # the hung syncs return now, not 120 s later
            runtime.close()
        # the caller was told whose task failed the run (the flow fails that agent's update task run with it)
        told = [e for e in events if isinstance(e, AgentFailed)]
        agent = str(err.value).split("'")[1]
        assert [e.agent for e in told] == [agent] and "did not finish within 2s" in told[0].error
    assert hang_over.exists()  # released, the hung syncs ended: closing the cluster waited for its worker threads


def test_an_agent_moves_to_a_free_slot_with_its_whole_state(tmp_path: Path, address: str) -> None:
    from flexmarl.orchestrator.runtime import RunContext, Runtime
    from flexmarl.run.prepare import prepare_run

    cfg = load_config(preset="fan_out", overrides=[*SMALL, *MODES["flexmarl"]])
    _, reference = run_mode(cfg, tmp_path / "reference", address)

    run_id, store_uri = prepare_run(cfg, tmp_path / "moving")
    runtime = Runtime(RunContext(run_id, str(tmp_path / "moving"), store_uri, address), cfg)
    try:
        crowded = runtime.slots[0]
        runtime.trainers = {a: crowded for a in cfg.agents}  # every state starts on one of the two slots
        runtime.start_engines()
        result = runtime.run()
        moved = {a for a, w in runtime.trainers.items() if w != crowded}
        weights = {a: runtime.weights(a) for a in cfg.agents}
    finally:
        runtime.close()
    assert moved, "an agent should have taken the free slot"
    assert {s.worker for s in result.spans if s.kind == "swap"} == set(runtime.slots)  # parked, then resumed
    assert drift(reference, weights, cfg) <= DRIFT_TOLERANCE  # the move carried weights, optimizer state and version
    # each move that found its state read ahead shows that read as a background swap span on its slot
    reads = [s for s in result.spans if s.background]
    assert result.state_moves and len(reads) == sum(m.prefetched for m in result.state_moves)
    assert all(s.kind == "swap" and s.worker in runtime.slots for s in reads)


def test_the_balancer_moves_slots_to_the_skewed_agent_and_records_queues(tmp_path: Path, address: str) -> None:
    _, result, _, _ = run("flexmarl", tmp_path, address)
    cfg = load_config(preset="fan_out")
    # the solver answers three times per episode: its queue outgrows the planner's and takes the planner's slot
    assert any(m.target == "solver" for m in result.moves), result.moves
    for m in result.moves:
        assert m.target_load - m.source_load > cfg.rollout.balance_threshold
    traced = {agent for _, agent, depth in result.queue_trace if depth > 0}
    assert traced == set(cfg.agents)
    # a planner batch finishes at once: its 8 episodes put 3 solver requests each in the solver's queue
    assert max(d for _, a, d in result.queue_trace if a == "solver") >= 8

    _, static, _, _ = run("no-lb", tmp_path, address)
    assert static.moves == []


def test_dynamic_sampling_drops_zero_variance_groups_in_every_mode(tmp_path: Path, address: str, monkeypatch) -> None:
    """Groups whose rewards have no variance are committed but not trained, and counted; a global batch left
    with nothing (the solver's, here, whose reward is constant) still completes its step and version."""
    import zlib

    import torch

    from flexmarl.models.loading import load_model, resolve_model
    from flexmarl.orchestrator.coverage import training_coverage
    from flexmarl.workloads.registry import REWARDS
    from storage.verify import verify_store

    def mixed(x) -> float:  # half of the inputs: constant; the others: did the solver's output parse
        if zlib.crc32(x.problem.input_id.encode()) % 2:
            return 1.0
        return float(x.parsed_outputs.get(x.parents[0]) is not None)

    # scoring runs in the driver (this process), so patching the registry here is what the run uses
    monkeypatch.setitem(REWARDS, "correct_answer", lambda x: 0.0)
    monkeypatch.setitem(REWARDS, "verdict_matches", mixed)
    weights, stores = {}, {}
    for mode in ("sync", "flexmarl"):
        cfg = load_config(preset="tiny", overrides=[*SMALL, *MODES[mode], "training.dynamic_sampling=true",
                                                    "training.loss_type=dr_grpo"])
        _, weights[mode] = run_mode(cfg, tmp_path / mode, address)
        stores[mode] = ExperienceStore(tmp_path / mode / "store")
    assert drift(weights["sync"], weights["flexmarl"], cfg) <= DRIFT_TOLERANCE
    start = load_model(resolve_model("tiny", seed=cfg.run.seed)).state_dict()
    assert all(torch.equal(weights["sync"]["solver"][k], start[k]) for k in start)  # nothing to train
    assert any(not torch.equal(weights["sync"]["verifier"][k], start[k]) for k in start)

    store = stores["flexmarl"]
    assert verify_store(store) == []
    assert training_coverage(store, cfg).exact  # the dropped samples are not lost: by design
    updates = store.read("updates").to_pylist()
    for agent in cfg.agents:
        samples = store.read_samples(agent, columns=["sample_id", "input_id", "node", "step", "reward", "status"])
        assert set(samples["status"].to_pylist()) == {"rewarded"}  # dropped samples stay committed
        mine = sorted((u for u in updates if u["agent"] == agent), key=lambda u: u["policy_version"])
        assert [u["policy_version"] for u in mine] == [1, 2]
        for update in mine:
            step = update["policy_version"] - 1
            groups: dict = {}
            for row in samples.filter(pc.field("step") == step).to_pylist():
                groups.setdefault((row["input_id"], row["node"]), []).append(row)
            kept = {r["sample_id"] for g in groups.values() if len({r["reward"] for r in g}) > 1 for r in g}
            dropped = sum(len({r["reward"] for r in g}) == 1 for g in groups.values())
            assert set(update["consumed_ids"]) == kept, (agent, step)
            assert dict(update["metrics"])["groups/dropped_zero_variance"] == dropped
            if kept:  # dr_grpo: the dropped samples are not in the normaliser, and the agent's max_new_tokens is
                max_new_tokens = cfg.agents[agent].sampling.max_new_tokens
                assert dict(update["metrics"])["loss/normaliser"] == len(kept) * max_new_tokens
            if agent == "solver":
                assert update["consumed_ids"] == [] and dropped == cfg.run.queries_per_step
                assert dict(update["metrics"])["micro_batches"] == 0
        if agent == "verifier":  # the mix this test is about: some groups dropped, some trained
            assert any(u["consumed_ids"] for u in mine)
            assert any(dict(u["metrics"])["groups/dropped_zero_variance"] for u in mine)


def test_rewards_run_off_the_driver_loop_which_dispatches_meanwhile(tmp_path: Path, address: str,
                                                                    monkeypatch) -> None:
    """A slow reward (here 0.1 s, as a sandboxed code run may take seconds) runs in a thread: while it runs,
    the loop goes on submitting the other agents' and groups' work, and the run still trains every step."""
    slow: list[tuple[float, float, str]] = []
    correct = REWARDS["correct_answer"]

    def slow_correct(x):
        start = time.time()
        time.sleep(0.1)
        slow.append((start, time.time(), threading.current_thread().name))
        return correct(x)

    monkeypatch.setitem(REWARDS, "correct_answer", slow_correct)
    submitted: list[float] = []
    cfg = load_config(preset="fan_out", overrides=[*SMALL, *MODES["flexmarl"]])
    result, _ = train(cfg, tmp_path / "run", address,
                      on_submit=lambda kind, agent, worker: submitted.append(time.time()))
    assert len(result.updates) == 2 * len(cfg.agents)
    assert slow and all(name.startswith("rewards") for _, _, name in slow)
    during = [t for t in submitted if any(start < t < end for start, end, _ in slow)]
    assert during, "nothing was dispatched while a reward ran: the loop waited for it"
