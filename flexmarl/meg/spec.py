"""The multi-agent execution graph (MEG) as declared in YAML: agents, nodes and edges.

A node is one invocation of an agent; an edge ``[a, b]`` says node ``b``'s prompt is built from node
``a``'s output, which the template of ``b`` reads as ``{a}``. The other template fields come from the
workload's task (``{question}``).

Example:
    agents:
      solver:   {model: tiny, prompt: "Solve: {question}", parser: last_number, reward: correct_answer}
      verifier: {model: tiny, prompt: "{question}\\nAnswer: {solver}\\nCorrect? 1 or 0", parser: verdict,
                 reward: verdict_matches}
    graph:
      nodes: [{name: solver, agent: solver}, {name: verifier, agent: verifier}]
      edges: [[solver, verifier]]
"""

from __future__ import annotations

import re
import string
from typing import Any
from graphlib import CycleError, TopologicalSorter

from pydantic import Field, field_validator, model_validator

from flexmarl.configbase import Strict, did_you_mean
from flexmarl.models.loading import check_model_setting
from flexmarl.workloads.registry import PARSERS, REWARDS

NAME = r"^[a-z][a-z0-9_]{0,39}$"  # agent and node names become table and directory names


class SamplingConfig(Strict):
    max_new_tokens: int = Field(64, ge=1, le=8192)
    """Longest response, in tokens."""
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    """Sampling temperature; the trainer scores tokens at the same temperature."""


class AgentSpec(Strict):
    model: str = "tiny"
    """'tiny', 'smollm2-135m-instruct', a local Hugging Face model directory or a local .gguf file.
    Agents may name the same model: each still trains its own copy of the weights."""
    prompt: str
    """User message template; ``{field}`` reads a task field or a parent node's response."""
    system: str | None = None
    """Optional system message."""
    parser: str
    """Registered output parser (see ``flexmarl.workloads.registry.PARSERS``)."""
    reward: str
    """Registered reward function (see ``flexmarl.workloads.registry.REWARDS``)."""
    sampling: SamplingConfig = SamplingConfig()
    max_staleness: int | None = Field(None, ge=0)
    """This agent's staleness bound; null uses ``train.max_staleness``."""
    training: dict[str, Any] = {}
    """This agent's trainer settings that differ from ``training`` (e.g. ``{lr: 1e-5, kl_coef: 0.01}``)."""

    @field_validator("model")
    @classmethod
    def _model_exists(cls, model: str) -> str:
        check_model_setting(model)  # raises ModelError, a ValueError, for a path that does not exist
        return model

    @field_validator("parser")
    @classmethod
    def _parser_registered(cls, parser: str) -> str:
        if parser not in PARSERS:
            raise ValueError(f"unknown parser {parser!r}{did_you_mean(parser, list(PARSERS))}; known: {sorted(PARSERS)}")
        return parser

    @field_validator("reward")
    @classmethod
    def _reward_registered(cls, reward: str) -> str:
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}{did_you_mean(reward, list(REWARDS))}; known: {sorted(REWARDS)}")
        return reward

    def template_fields(self) -> set[str]:
        return {f for _, f, _, _ in string.Formatter().parse(self.prompt) if f}


class NodeSpec(Strict):
    name: str = Field(pattern=NAME)
    """Node name, unique in the graph; children read its response as ``{name}``."""
    agent: str
    """The agent (a key of ``agents``) this node invokes."""


class GraphSpec(Strict):
    nodes: list[NodeSpec] = Field(min_length=1)
    """Agent invocations of one episode (see ``graph.nodes[]``)."""
    edges: list[tuple[str, str]] = []
    """``[parent, child]`` pairs: the child's prompt reads the parent's response as ``{parent}``."""

    @model_validator(mode="after")
    def _check_structure(self) -> GraphSpec:
        names = [n.name for n in self.nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate node names {duplicates}: give every node its own name")
        for parent, child in self.edges:
            for end in (parent, child):
                if end not in names:
                    raise ValueError(f"edge [{parent}, {child}] names unknown node {end!r}; nodes are {names}")
        try:
            self.order()
        except CycleError as exc:
            cycle = " -> ".join(exc.args[1])
            raise ValueError(
                f"the graph has a cycle ({cycle}); a MEG must be acyclic: unroll a loop into numbered nodes"
            ) from None
        return self

    def parents(self, node: str) -> list[str]:
        return [p for p, c in self.edges if c == node]

    def order(self) -> list[str]:
        """Nodes in a deterministic topological order (ties broken by declaration order)."""
        position = {n.name: i for i, n in enumerate(self.nodes)}
        sorter = TopologicalSorter({n.name: self.parents(n.name) for n in self.nodes})
        sorter.prepare()
        order: list[str] = []
        while sorter.is_active():
            ready = sorted(sorter.get_ready(), key=position.__getitem__)
            order.extend(ready)
            sorter.done(*ready)
        return order


class MEGSpec(Strict):
    agents: dict[str, AgentSpec] = Field(min_length=1)
    graph: GraphSpec

    @field_validator("agents")
    @classmethod
    def _agent_names(cls, agents: dict[str, AgentSpec]) -> dict[str, AgentSpec]:
        for name in agents:
            if not re.match(NAME, name):
                raise ValueError(f"agent name {name!r} must be lower case letters, digits and '_' ({NAME})")
        return agents

    @model_validator(mode="after")
    def _check_agents(self) -> MEGSpec:
        for node in self.graph.nodes:
            if node.agent not in self.agents:
                raise ValueError(
                    f"node {node.name!r} uses unknown agent {node.agent!r}; agents are {sorted(self.agents)}"
                )
        unused = sorted(set(self.agents) - {n.agent for n in self.graph.nodes})
        if unused:
            raise ValueError(f"agents {unused} are declared but no graph node uses them")
        return self

    def check_templates(self, task_fields: set[str]) -> None:
        """Every ``{field}`` of a node's prompt must be a task field or one of the node's parents."""
        for node in self.graph.nodes:
            available = task_fields | set(self.graph.parents(node.name))
            missing = sorted(self.agents[node.agent].template_fields() - available)
            if missing:
                raise ValueError(
                    f"node {node.name!r} (agent {node.agent!r}): prompt field(s) {missing} are provided by "
                    f"neither the task nor a parent node; available: {sorted(available)}"
                )

    def nodes_of(self, agent: str) -> list[str]:
        return [n.name for n in self.graph.nodes if n.agent == agent]
