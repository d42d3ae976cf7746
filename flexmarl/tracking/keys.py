"""Stable, namespaced metric keys of one agent update: ``<agent>/<group>/<name>``.

Every tracker logs these names, so a dashboard built on them keeps working as the trainer grows new
statistics. The groups:

    <agent>/reward/mean            mean reward of the step's rewarded samples, groups dropped by dynamic sampling
                                   included (absent when none was rewarded)
    <agent>/loss/policy            the policy loss of the global batch
    <agent>/loss/normaliser        what the summed losses were divided by (loss_type: responses, tokens, or
                                   responses x max_new_tokens)
    <agent>/policy/<stat>          the trainer's batch statistics: clipfrac, ratio_mean, kl, stale_fraction, ...
                                   is_weight_mean, is_weight_at_cap (importance weights to the rollout policy)
    <agent>/groups/dropped_zero_variance  groups without signal left out by training.dynamic_sampling (0 without
                                   it): rewards without variance, or one class judged under verdict_mixed
    <agent>/optim/grad_norm        gradient norm before clipping (when training.max_grad_norm is set)
    <agent>/batch/samples          samples the update trained on
    <agent>/batch/tokens           their response tokens
    <agent>/batch/micro_batches    micro-batches accumulated into the update
    <agent>/rollout/staleness      mean versions between a sample's generator and the weights it updated
    <agent>/rollout/queue_depth    the agent's requests waiting for a replica when the update finished
    <agent>/throughput/tokens_per_s  batch tokens over the seconds since the agent's previous update
    <agent>/update/skipped         1 when the loss was not finite and the weights were left alone
    <agent>/update/finished_s      seconds since the pipeline started

Example:
    >>> update_metrics(event, previous_s=1.5)["solver/reward/mean"]
    0.25
"""

from __future__ import annotations

from flexmarl.orchestrator.records import UpdateEvent

# trainer metric name -> its key below the agent (names already under policy/ or loss/ keep their name)
TRAINER_KEYS = {"grad_norm": "optim/grad_norm", "micro_batches": "batch/micro_batches", "skipped": "update/skipped"}


def update_metrics(event: UpdateEvent, *, previous_s: float) -> dict[str, float]:
    """The update's metrics under stable keys; ``previous_s``: when the agent's previous update finished
    (0.0 for its first), in the same clock as ``event.finished_at``."""
    a = event.agent
    out = {f"{a}/{TRAINER_KEYS.get(k, k)}": float(v) for k, v in event.metrics.items()}
    if event.mean_reward is not None:
        out[f"{a}/reward/mean"] = float(event.mean_reward)
    elapsed = event.finished_at - previous_s
    out.update({
        f"{a}/batch/samples": float(event.samples),
        f"{a}/batch/tokens": float(event.tokens),
        f"{a}/rollout/staleness": float(event.staleness),
        f"{a}/rollout/queue_depth": float(event.queue_depth),
        f"{a}/update/skipped": float(event.skipped),
        f"{a}/update/finished_s": float(event.finished_at),
    })
    if elapsed > 0:
        out[f"{a}/throughput/tokens_per_s"] = event.tokens / elapsed
    return out


def run_metrics(report: dict) -> dict[str, float]:
    """Run-level numbers of the final report, under ``run/``."""
    return {
        "run/wall_s": float(report["wall_s"]),
        "run/pipeline_s": float(report["pipeline_s"]),
        "run/utilization": float(report["utilization"]),
        "run/tokens_per_s": float(report["tokens_per_s"]),
        "run/store_write_s": float(report["store_write_s"]),
        "run/store_read_s": float(report["store_read_s"]),
    }
