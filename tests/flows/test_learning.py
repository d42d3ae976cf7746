"""The framework's CartPole: two tiny models learn to copy a digit from scratch, through the real flow.

The ``copy`` preset runs the whole product: the Prefect flow, a Dask LocalCluster, the Delta store, the
micro-batch pipeline, GRPO with dynamic sampling, weight syncs to the rollout replicas. A random byte-level
model writes the right digit about once in a hundred samples and a constant answer earns 0.1, so a high
reward means the agents read their inputs. The test fails when GRPO is broken in a way that matters: a
flipped advantage, a response mask on the wrong tokens, weight syncs that never reach the replicas, or
samples attributed to the wrong policy version (each was checked once by breaking it on purpose).
"""

from __future__ import annotations

from statistics import mean

from flows.train import train_run


def test_both_agents_of_the_copy_preset_learn_from_scratch(prefect_api, tmp_path) -> None:
    report = train_run(preset="copy", run_dir=str(tmp_path / "run"))
    for agent in ("writer", "echo"):
        rewards = report["agents"][agent]["mean_reward"]
        assert len(rewards) == 80 and None not in rewards, (agent, rewards)
        first, last = mean(rewards[:10]), mean(rewards[-10:])
        assert last >= 0.8 and last >= 3 * first, f"{agent}: first 10 updates {first:.3f}, last 10 {last:.3f}"
