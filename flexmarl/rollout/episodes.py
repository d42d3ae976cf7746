"""Episodes of a MEG: their data, how prompts are built, and which nodes become ready when.

The pipeline runtime (``flexmarl/orchestrator/pipeline.py``) samples ready nodes on the replicas.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from flexmarl.meg.graph import sample_id
from flexmarl.meg.spec import MEGSpec
from flexmarl.rollout.backend import GenerationResult
from flexmarl.workloads.datasets import Problem
from flexmarl.workloads.registry import parse


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
    problem: Problem
    trajectory_id: int
    step: int
    outputs: dict[str, NodeOutput] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # nodes a loop's early stop left out: never generated
    error: str | None = None  # set when a reward function raised: the episode is not trained on

    @property
    def episode_id(self) -> str:
        return f"{self.problem.input_id}_{self.trajectory_id}"


def request_seed(run_seed: int, sid: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def render_prompt(tok: PreTrainedTokenizerBase, prompt: str, system: str | None, fields: dict[str, str]) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt.format(**fields)})
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


class EpisodeGraph:
    """The MEG as the rollout walks it: the expanded graph (copies and loops unrolled), turns, layers,
    prompts, and what becomes ready.

    A node of an episode is ready the moment every parent has run or was skipped by a loop's early stop;
    ``record`` stores a node's output and returns the nodes it made ready. The pipeline runtime decides
    when ready nodes are sampled.
    """

    def __init__(self, spec: MEGSpec, tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
        self.spec = spec
        self.tokenizers = tokenizers
        self.graph = spec.graph.expanded
        self.order = self.graph.order()
        self.turn = {node: i for i, node in enumerate(self.order)}
        self.agent_of = {n.name: n.agent for n in self.graph.nodes}
        self.layer: dict[str, int] = {}  # longest path from a root: the layered (sync) schedule's stages
        for node in self.order:
            self.layer[node] = 1 + max((self.layer[p] for p in self.graph.parents(node)), default=-1)
        self.roots = [n for n in self.order if not self.graph.parents(n)]

    def sample_id(self, ep: Episode, node: str) -> str:
        return sample_id(ep.problem.input_id, self.turn[node], ep.trajectory_id)

    def prompt(self, ep: Episode, node: str) -> list[int]:
        role = self.spec.role(node)
        fields = dict(ep.problem.fields)
        fields.update(self.graph.render_fields(node, {n: out.text for n, out in ep.outputs.items()}))
        return render_prompt(self.tokenizers[role.agent], role.prompt, role.system, fields)

    def record(self, ep: Episode, node: str, prompt_ids: list[int], result: GenerationResult) -> list[str]:
        """Store the node's output in the episode; return the nodes that are now ready.

        Also returns, through ``ep.skipped``, the later loop turns an early stop removed.
        """
        agent = self.agent_of[node]
        text = self.tokenizers[agent].decode(result.response_ids, skip_special_tokens=True)
        ep.outputs[node] = NodeOutput(
            node=node,
            agent=agent,
            turn=self.turn[node],
            sample_id=result.request_id,
            prompt_ids=prompt_ids,
            result=result,
            text=text,
            parsed=parse(self.spec.role(node).parser, text, next(
                (ep.outputs[p].parsed for p in self.graph.parents(node) if p in ep.outputs), None)),
            # skipped turns have no sample to point at
            parent_ids=[ep.outputs[p].sample_id for p in self.graph.parents(node) if p in ep.outputs],
        )
        resolved = [node, *self._skip_after_stop(ep, node)]
        ready: list[str] = []
        for done in resolved:
            for child in self.graph.children(done):
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

    def is_done(self, ep: Episode) -> bool:
        return len(ep.outputs) + len(ep.skipped) == len(self.order)
