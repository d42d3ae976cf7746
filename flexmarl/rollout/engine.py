"""The rollout engine: runs MEG episodes on the agents' replicas, dependency-parallel and batched per agent.

A node of an episode becomes ready the moment all its parents are done; nothing waits for a whole layer
of the graph or for other episodes. Ready requests queue per agent, and whenever a replica is free it takes
everything waiting for its agent (up to ``max_batch_size``) as one batch. The generation requests are plain
Dask tasks pinned to the replica's worker.
"""

from __future__ import annotations

import hashlib
import queue
import time
from collections import deque
from dataclasses import dataclass, field

from distributed import Client, Future
from transformers import PreTrainedTokenizerBase

from flexmarl.meg.spec import MEGSpec
from flexmarl.rollout import replica
from flexmarl.rollout.backend import GenerationRequest, GenerationResult
from flexmarl.workloads.datasets import TaskItem
from flexmarl.workloads.registry import PARSERS


@dataclass
class NodeOutput:
    node: str
    agent: str
    turn: int
    sample_id: str
    prompt_ids: list[int]
    result: GenerationResult
    text: str
    parsed: str | None
    parent_ids: list[str]
    reward: float | None = None
    advantage: float | None = None


@dataclass
class Episode:
    task: TaskItem
    trajectory_id: int
    step: int
    outputs: dict[str, NodeOutput] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # nodes a loop's early stop left out: never generated
    error: str | None = None  # set when a reward function raised: the episode is not trained on

    @property
    def episode_id(self) -> str:
        return f"{self.task.input_id}_{self.trajectory_id}"


def sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    return f"{input_id}_{turn}_{trajectory_id}"


def request_seed(run_seed: int, sid: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def render_prompt(tok: PreTrainedTokenizerBase, prompt: str, system: str | None, fields: dict[str, str]) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt.format(**fields)})
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


class RolloutEngine:
    """Drives episodes of one MEG over Dask.

    Args:
        client: a Dask client of the cluster holding the replicas.
        spec: the graph and its agents.
        tokenizers: one per agent, to build prompts and decode responses on the driver.
        replicas: per agent, the worker addresses holding its replicas.
        max_batch_size: most requests per generation batch.
        timeout_s: longest wait for one batch.
        seed: run seed; each request's sampling seed derives from it and the sample id.
    """

    def __init__(
        self,
        client: Client,
        spec: MEGSpec,
        tokenizers: dict[str, PreTrainedTokenizerBase],
        replicas: dict[str, list[str]],
        *,
        max_batch_size: int,
        timeout_s: float,
        seed: int,
    ) -> None:
        self.client = client
        self.spec = spec
        self.tokenizers = tokenizers
        self.replicas = replicas
        self.max_batch_size = max_batch_size
        self.timeout_s = timeout_s
        self.seed = seed
        self.graph = spec.graph.expanded  # copies and loops unrolled into plain nodes
        self.order = self.graph.order()
        self.turn = {node: i for i, node in enumerate(self.order)}
        self.agent_of = {n.name: n.agent for n in self.graph.nodes}

    def run(self, tasks: list[TaskItem], *, step: int, group_size: int) -> list[Episode]:
        """Sample ``group_size`` episodes per task; returns them with the output of every node that ran."""
        episodes = [Episode(task, j, step) for task in tasks for j in range(group_size)]
        queues: dict[str, deque[tuple[Episode, str]]] = {a: deque() for a in self.spec.agents}
        for ep in episodes:
            for node in self.order:
                if not self.graph.parents(node):
                    queues[self.agent_of[node]].append((ep, node))

        busy: dict[tuple[str, str], Future] = {}  # (agent, replica address) -> its running batch
        inflight: dict[Future, list[tuple[Episode, str, list[int]]]] = {}
        finished: queue.Queue[Future] = queue.Queue()  # filled by the futures' done callbacks
        while any(queues.values()) or inflight:
            for agent, waiting in queues.items():
                for address in self.replicas[agent]:
                    if not waiting:
                        break
                    if (agent, address) in busy:
                        continue
                    items = [waiting.popleft() for _ in range(min(self.max_batch_size, len(waiting)))]
                    batch = [(ep, node, self._prompt(ep, node)) for ep, node in items]
                    fut = self._submit(agent, address, batch)
                    busy[(agent, address)] = fut
                    inflight[fut] = batch
                    fut.add_done_callback(finished.put)
            try:
                fut = finished.get(timeout=self.timeout_s)
            except queue.Empty:
                stuck = sorted(f"{a}@{addr}" for a, addr in busy)
                raise TimeoutError(
                    f"no generation batch finished within {self.timeout_s:.0f}s (waiting on {stuck}); "
                    "raise rollout.request_timeout_s or check the workers"
                ) from None
            batch = inflight.pop(fut)
            busy = {k: f for k, f in busy.items() if f is not fut}
            for (ep, node, prompt_ids), result in zip(batch, fut.result(), strict=True):
                self._record(ep, node, prompt_ids, result)
                for child in self._ready_children(ep, node):
                    queues[self.agent_of[child]].append((ep, child))
        return episodes

    def _children(self, node: str) -> list[str]:
        return self.graph.children(node)

    def _ready_children(self, ep: Episode, node: str) -> list[str]:
        """Nodes that ``node`` finishing makes ready: every parent has run or was skipped by an early stop."""
        resolved = [node, *self._skip_after_stop(ep, node)]
        ready: list[str] = []
        for done in resolved:
            for child in self._children(done):
                if child in ep.skipped or child in ready:
                    continue
                if all(p in ep.outputs or p in ep.skipped for p in self.graph.parents(child)):
                    ready.append(child)
        return ready

    def _skip_after_stop(self, ep: Episode, node: str) -> list[str]:
        """Bounded loops: once ``node`` meets its loop's stop condition, skip the loop's later turns.

        The skipped nodes were not started (validation makes each wait for the stop node), so they are
        never generated and leave no samples. Returns the newly skipped nodes.
        """
        skip = [n for n in self.graph.skipped_after(node, ep.outputs[node].parsed) if n not in ep.skipped]
        ep.skipped.update(skip)
        return skip

    def _prompt(self, ep: Episode, node: str) -> list[int]:
        agent = self.spec.agents[self.agent_of[node]]
        fields = dict(ep.task.fields)
        fields.update(self.graph.render_fields(node, {n: out.text for n, out in ep.outputs.items()}))
        return render_prompt(self.tokenizers[self.agent_of[node]], agent.prompt, agent.system, fields)

    def _submit(self, agent: str, address: str, batch: list[tuple[Episode, str, list[int]]]) -> Future:
        sampling = self.spec.agents[agent].sampling
        requests = []
        for ep, node, prompt_ids in batch:
            sid = sample_id(ep.task.input_id, self.turn[node], ep.trajectory_id)
            requests.append(
                GenerationRequest(sid, prompt_ids, sampling.max_new_tokens, sampling.temperature,
                                  request_seed(self.seed, sid))
            )
        return self.client.submit(
            replica.generate, agent, requests, workers=[address], allow_other_workers=False, pure=False,
            key=f"generate-{agent}-{requests[0].request_id}-{time.monotonic_ns()}",
        )

    def _record(self, ep: Episode, node: str, prompt_ids: list[int], result: GenerationResult) -> None:
        agent = self.agent_of[node]
        text = self.tokenizers[agent].decode(result.response_ids, skip_special_tokens=True)
        parents = [p for p in self.graph.parents(node) if p in ep.outputs]  # skipped turns have no sample
        ep.outputs[node] = NodeOutput(
            node=node,
            agent=agent,
            turn=self.turn[node],
            sample_id=result.request_id,
            prompt_ids=prompt_ids,
            result=result,
            text=text,
            parsed=PARSERS[self.spec.agents[agent].parser](text),
            parent_ids=[ep.outputs[p].sample_id for p in parents],
        )
