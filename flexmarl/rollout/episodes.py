"""Episodes of a MEG: their data, how prompts are built, and which nodes become ready when.

The pipeline runtime (``flexmarl/orchestrator/pipeline.py``) samples ready nodes on the replicas.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from flexmarl.meg.spec import MEGSpec
from flexmarl.rollout.backend import GenerationResult
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


class EpisodeGraph:
    """The MEG as the rollout walks it: graph order, turns, layers, prompts, and what becomes ready.

    A node of an episode is ready the moment all its parents are done; ``record`` stores a node's output
    and returns the children it made ready. The pipeline runtime decides when ready nodes are sampled.
    """

    def __init__(self, spec: MEGSpec, tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
        self.spec = spec
        self.tokenizers = tokenizers
        self.order = spec.graph.order()
        self.turn = {node: i for i, node in enumerate(self.order)}
        self.agent_of = {n.name: n.agent for n in spec.graph.nodes}
        self.parents = {node: spec.graph.parents(node) for node in self.order}
        self.children = {node: [c for p, c in spec.graph.edges if p == node] for node in self.order}
        self.layer: dict[str, int] = {}  # longest path from a root: the layered (sync) schedule's stages
        for node in self.order:
            self.layer[node] = 1 + max((self.layer[p] for p in self.parents[node]), default=-1)
        self.roots = [n for n in self.order if not self.parents[n]]

    def sample_id(self, ep: Episode, node: str) -> str:
        return sample_id(ep.task.input_id, self.turn[node], ep.trajectory_id)

    def prompt(self, ep: Episode, node: str) -> list[int]:
        agent = self.spec.agents[self.agent_of[node]]
        fields = dict(ep.task.fields)
        fields.update({p: ep.outputs[p].text for p in self.parents[node]})
        return render_prompt(self.tokenizers[self.agent_of[node]], agent.prompt, agent.system, fields)

    def record(self, ep: Episode, node: str, prompt_ids: list[int], result: GenerationResult) -> list[str]:
        """Store the node's output in the episode; return the children that are now ready."""
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
            parsed=PARSERS[self.spec.agents[agent].parser](text),
            parent_ids=[ep.outputs[p].sample_id for p in self.parents[node]],
        )
        return [c for c in self.children[node] if all(p in ep.outputs for p in self.parents[c])]

    def is_done(self, ep: Episode) -> bool:
        return len(ep.outputs) == len(self.order)
