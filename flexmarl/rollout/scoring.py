"""Rewards, group advantages and the Arrow rows the store keeps for finished episodes."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np
import pyarrow as pa

from flexmarl.meg.spec import MEGSpec
from flexmarl.rollout.episodes import Episode, NodeOutput
from flexmarl.training.config import TrainerConfig
from flexmarl.training.losses import agent_scaled, group_advantages
from flexmarl.workloads.registry import BALANCED_BY_CLASS, JUDGED_CLASS, JUDGED_ON_GROUP, MIXED_ONLY, REWARDS, parse
from flexmarl.workloads.rewards import RewardInput, balanced_accuracy, class_balanced
from storage.schema import EPISODE_SCHEMA, SAMPLE_SCHEMA, SampleStatus
from storage.store import now

log = logging.getLogger(__name__)


def score(episodes: list[Episode], spec: MEGSpec, trainers: dict[str, TrainerConfig]) -> None:
    """Fill every node's reward, then its advantage within its group (same input and node).

    Each agent's ``advantage`` setting says how: 'group' scales by the group's std; 'group_mean' and
    'agent' only centre here ('agent' is scaled once the agent's whole batch is known: ``scale_by_agent``).
    Rewards listed in ``BALANCED_BY_CLASS`` (``verdict_balanced``) are then reweighted within each
    group so that every class of sample weighs the same (``rewards.class_balanced``); those in ``JUDGED_ON_GROUP``
    are replaced by the balanced accuracy of the judge's result on every answer its group judged; those in
    ``MIXED_ONLY`` (the verifier's ``verdict_mixed``) get no advantage in a group whose samples judge one class only.

    A reward function that raises marks its episode failed (``episode.error``); a failed episode's samples keep
    no reward and are not trained on, and the run goes on. Nodes a loop's early stop skipped have no output,
    so they get no reward and join no group: a group holds only the samples that exist.
    """
    classes: dict[int, bool] = {}  # id(output) -> the class a judge's sample judges, for the groups below
    judged: dict[int, str | None] = {}  # id(output) -> the answer a judge's sample judges, for JUDGED_ON_GROUP
    for ep in episodes:
        rewards: dict[str, float] = {}
        for node, x in reward_inputs(ep, spec).items():
            out = ep.outputs[node]
            reward_name = spec.role(node).reward
            try:
                rewards[node] = float(REWARDS[reward_name](x))
                if reward_name in BALANCED_BY_CLASS | MIXED_ONLY | JUDGED_ON_GROUP:
                    classes[id(out)] = JUDGED_CLASS[reward_name](x)
                if reward_name in JUDGED_ON_GROUP:
                    judged[id(out)] = x.parsed_outputs.get(x.parents[0]) if x.parents else None
            except Exception as exc:  # noqa: BLE001 - reward code may fail on odd outputs: record and go on
                ep.error = f"reward {reward_name!r} of node {node!r} failed: {type(exc).__name__}: {exc}"
                log.warning("episode %s failed, the run goes on without its samples: %s; fix that reward function "
                            "(flexmarl/workloads/rewards.py)", ep.episode_id, ep.error)
                break
        if ep.error is None:
            for node, reward in rewards.items():
                ep.outputs[node].reward = reward

    groups: dict[tuple[str, str], list] = defaultdict(list)
    for ep in episodes:
        if ep.error is None:
            for node, out in ep.outputs.items():
                groups[(ep.problem.input_id, node)].append(out)
    for outs in groups.values():
        reward_name = spec.role(outs[0].node).reward
        if reward_name in BALANCED_BY_CLASS:
            for out, r in zip(outs, class_balanced([o.reward for o in outs], [classes[id(o)] for o in outs]),
                              strict=True):
                out.reward = r
        if reward_name in JUDGED_ON_GROUP:
            parser, group_classes = spec.role(outs[0].node).parser, [classes[id(o)] for o in outs]
            for out in outs:
                out.reward = balanced_accuracy([parse(parser, out.text, judged[id(o)]) for o in outs], group_classes)
        if reward_name in MIXED_ONLY and len({classes[id(o)] for o in outs}) < 2:
            for out in outs:
                out.advantage = 0.0
            continue
        trainer = trainers[outs[0].agent]
        advantages = group_advantages(
            [o.reward for o in outs], ["g"] * len(outs), eps=trainer.adv_eps, scale=trainer.advantage == "group"
        )
        for out, adv in zip(outs, advantages, strict=True):
            out.advantage = adv


def reward_inputs(ep: Episode, spec: MEGSpec) -> dict[str, RewardInput]:
    """What each node of the episode that ran shows its reward function."""
    graph = spec.graph.expanded
    parsed = {node: out.parsed for node, out in ep.outputs.items()}
    final = final_nodes(ep, spec)
    return {node: RewardInput(node, out.parsed, ep.problem, parsed, [p for p in graph.parents(node) if p in ep.outputs],
                              final, out.text)
            for node, out in ep.outputs.items()}


def final_nodes(ep: Episode, spec: MEGSpec) -> tuple[str, ...]:
    """The episode's nodes that ran and whose output no node that ran reads (e.g. the aggregator)."""
    graph = spec.graph.expanded
    return tuple(n for n in ep.outputs if not any(c in ep.outputs for c in graph.children(n)))


def scale_by_agent(outputs: list[NodeOutput], *, eps: float) -> None:
    """Dr. MAS: divide group-centred advantages by the std of the agent's rewards over its global batch."""
    scored = [o for o in outputs if o.reward is not None and o.advantage is not None]
    for out, adv in zip(scored, agent_scaled([o.advantage for o in scored], [o.reward for o in scored], eps=eps),
                        strict=True):
        out.advantage = adv


def signal_free_groups(keys: Sequence[Hashable], advantages: Sequence[float]) -> set[Hashable]:
    """The GRPO groups (samples sharing a key) whose advantages are all 0, so they carry no policy gradient.

    These are the groups whose rewards are all equal, a group of one included (their advantages are exactly 0
    in every ``advantage`` mode: DAPO's dynamic sampling drops them), and the one-class groups of a
    ``MIXED_ONLY`` reward.

    >>> sorted(signal_free_groups(["a", "a", "b", "b", "c"], [0.7, -0.7, 0.0, 0.0, 0.0]))
    ['b', 'c']
    """
    by_key: dict[Hashable, list[float]] = defaultdict(list)
    for key, advantage in zip(keys, advantages, strict=True):
        by_key[key].append(advantage)
    return {key for key, values in by_key.items() if not any(values)}


def trainable_samples(rewarded: pa.Table, *, dynamic_sampling: bool) -> tuple[pa.Table, int]:
    """The rows of a micro-batch's rewarded samples the trainer consumes, and the groups dropped.

    ``rewarded`` holds whole GRPO groups (``input_id``, ``node``) with their ``advantage``. Without
    ``dynamic_sampling`` every row is trained; with it, the groups without signal (``signal_free_groups``) are
    left out (they stay in the store, unconsumed).
    """
    if not dynamic_sampling or not rewarded.num_rows:
        return rewarded, 0
    keys = list(zip(rewarded["input_id"].to_pylist(), rewarded["node"].to_pylist(), strict=True))
    dropped = signal_free_groups(keys, rewarded["advantage"].to_pylist())
    if not dropped:
        return rewarded, 0
    keep = pa.array([key not in dropped for key in keys], pa.bool_())
    return rewarded.filter(keep), len(dropped)


def sample_rows(episodes: list[Episode], agent: str) -> pa.Table:
    """The agent's samples of ``episodes`` as store rows; responses and log-probs go from the results' arrays
    into Arrow list columns without a Python object per token."""
    created = now()
    rows, outputs = [], []
    for ep in episodes:
        for out in ep.outputs.values():
            if out.agent != agent:
                continue
            rewarded = ep.error is None and out.reward is not None
            outputs.append(out)
            rows.append({
                "sample_id": out.sample_id,
                "episode_id": ep.episode_id,
                "input_id": ep.problem.input_id,
                "turn": out.turn,
                "trajectory_id": ep.trajectory_id,
                "node": out.node,
                "agent": agent,
                "step": ep.step,
                "policy_version": out.result.policy_version,
                "prompt_ids": out.prompt_ids,
                "finish_reason": out.result.finish_reason,
                "parsed": out.parsed,
                "reward": out.reward if rewarded else None,
                "advantage": out.advantage if rewarded else None,
                "status": (SampleStatus.REWARDED if rewarded else SampleStatus.GENERATED).value,
                "parent_ids": out.parent_ids,
                "created_at": created,
            })
    columns: dict[str, object] = {name: [row[name] for row in rows] for name in SAMPLE_SCHEMA.names
                                  if name not in ("response_ids", "logprobs")}
    columns["response_ids"] = list_column([o.result.response_ids for o in outputs], pa.int32())
    columns["logprobs"] = list_column([o.result.logprobs for o in outputs], pa.float32())
    return pa.Table.from_pydict(columns, schema=SAMPLE_SCHEMA)


def list_column(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    """An Arrow list column with one row per array: one concatenation and an offsets buffer."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.empty(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def episode_rows(episodes: list[Episode]) -> pa.Table:
    created = now()
    rows = [
        {
            "episode_id": ep.episode_id,
            "input_id": ep.problem.input_id,
            "trajectory_id": ep.trajectory_id,
            "step": ep.step,
            "task": ep.problem.to_json(),
            "node_status": [(node, "done") for node in ep.outputs]
            + [(node, "skipped") for node in sorted(ep.skipped)],  # skipped: a loop stopped early
            "rewards": [(node, out.reward) for node, out in ep.outputs.items() if out.reward is not None],
            "outcome": "failed" if ep.error else "completed",
            "error": ep.error,
            "created_at": created,
        }
        for ep in episodes
    ]
    return pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)
