"""The multi-agent execution graph (MEG) as declared in YAML: agents, nodes, edges and bounded loops.

A node is one invocation of an agent; an edge ``[a, b]`` says node ``b``'s prompt is built from node
``a``'s output, which the template of ``b`` reads as ``{a}``. The other template fields come from the
workload's problem (``{question}``). A node may run as ``copies: k`` parallel instances (fan-out), and a
cycle must be declared as a loop with ``max_turns`` (and an optional early stop). ``GraphSpec.expanded``
holds the unrolled acyclic graph the rollout engine runs; ``flexmarl.meg.graph`` has the rules and
docs/meg.md the guide.

Example (a solver and a verifier taking up to 3 turns):
    agents:
      solver:   {model: tiny, prompt: "Solve: {question} {verifier}", parser: last_number, reward: correct_answer}
      verifier: {model: tiny, prompt: "{question}\\nAnswer: {solver}\\nCorrect? 1 or 0", parser: verdict,
                 reward: verdict_matches}
    graph:
      nodes: [{name: solver, agent: solver}, {name: verifier, agent: verifier}]
      edges: [[solver, verifier], [verifier, solver]]
      loops: [{nodes: [solver, verifier], max_turns: 3, stop_when: {node: verifier, parsed: correct}}]
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, Field, PrivateAttr, field_validator, model_validator

from flexmarl.configbase import Strict, did_you_mean
from flexmarl.meg.graph import DeclaredLoop, DeclaredNode, ExpandedGraph, expand
from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.names import check_model_setting
from flexmarl.workloads.registry import COMPARING_PARSERS, JUDGED_ON_GROUP, PARSERS, REWARD_PROBLEM_FIELDS, REWARDS

NAME = r"^[a-z][a-z0-9_]{0,39}$"  # agent and node names become table and directory names


def unregistered(kind: str, name: str, registry: dict) -> str:
    """The error for a parser or reward that is not in the allow-list (a dotted path is never imported)."""
    return (
        f"unknown {kind} {name!r}{did_you_mean(name, list(registry))}; known: {sorted(registry)}. A config names "
        f"only registered {kind}s, never import paths: to add one, list it in flexmarl/workloads/registry.py"
    )


def check_template(template: str, field: str) -> None:
    """A prompt template ``str.format`` can fill from named fields alone; the error says how to write it.

    Raises:
        ValueError: an unbalanced brace, a ``{}`` without a name, or a field that is not a plain name (``{a.b}``
            and ``{a[0]}`` would reach into Python objects).
    """
    literal = "write a literal brace as {{ or }}"
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"the {field} template does not parse ({exc}); close every {{field}}, or {literal}") from None
    for _, name, spec, _ in parts:
        if name is None:
            continue
        if not name.isidentifier() or "{" in (spec or ""):
            raise ValueError(
                f"the {field} template has the field {{{name}}}; a field is a plain name such as {{question}} or a "
                f"parent node's name, or {literal}"
            )


def checked_prompt(prompt: str) -> str:
    check_template(prompt, "prompt")  # the system message is sent as written, never formatted
    return prompt


def checked_parser(parser: str) -> str:
    if parser not in PARSERS and parser not in COMPARING_PARSERS:
        raise ValueError(unregistered("parser", parser, {**PARSERS, **COMPARING_PARSERS}))
    return parser


def checked_reward(reward: str) -> str:
    if reward not in REWARDS:
        raise ValueError(unregistered("reward", reward, REWARDS))
    return reward


# An agent's and a node's prompt template, parser and reward are checked alike
Prompt = Annotated[str, AfterValidator(checked_prompt)]
ParserName = Annotated[str, AfterValidator(checked_parser)]
RewardName = Annotated[str, AfterValidator(checked_reward)]


class SamplingConfig(Strict):
    max_new_tokens: int = Field(64, ge=1, le=8192)
    """Longest response, in tokens."""
    temperature: float = Field(1.0, gt=0.0, le=2.0)
    """Sampling temperature; the trainer scores tokens at the same temperature."""


class AgentSpec(Strict):
    model: str = "tiny"
    """'tiny', 'tiny-large', 'smollm2-135m-instruct', a local Hugging Face model directory or a .gguf file.
    Agents may name the same model: each trains its own copy of the weights, or, with ``adapter``, its own
    adapter on one shared copy of the model."""
    adapter: AdapterConfig | None = None
    """Train a LoRA adapter instead of the whole model, e.g. ``{type: lora, r: 8, alpha: 16}``: agents with the same
    ``model`` and an adapter share one base in each rollout replica and each training slot, and weight syncs,
    state moves and snapshots carry only the adapter. null: the agent trains all its weights."""
    prompt: Prompt
    """User message template; ``{field}`` reads a problem field or a parent node's response."""
    system: str | None = None
    """Optional system message."""
    parser: ParserName
    """Registered output parser (see ``flexmarl.workloads.registry.PARSERS``)."""
    reward: RewardName
    """Registered reward function (see ``flexmarl.workloads.registry.REWARDS``)."""
    sampling: SamplingConfig = SamplingConfig()
    max_staleness: int | None = Field(None, ge=0)
    """This agent's staleness bound; null uses ``run.max_staleness``."""
    training: dict[str, Any] = {}
    """This agent's trainer settings that differ from ``training`` (e.g. ``{lr: 1e-5, kl_coef: 0.01}``)."""

    @field_validator("model")
    @classmethod
    def _model_exists(cls, model: str) -> str:
        check_model_setting(model)  # raises ModelError, a ValueError, for a path that does not exist
        return model


class NodeSpec(Strict):
    name: str = Field(pattern=NAME)
    """Node name, unique in the graph; children read its response as ``{name}``."""
    agent: str
    """The agent (a key of ``agents``) this node invokes."""
    copies: int = Field(1, ge=1, le=64)
    """Fan-out: ``copies: k`` (k > 1) runs k instances ``name_0 .. name_{k-1}`` of the node, each sampled
    independently. A child reads all k responses as ``{name}`` (numbered ``Answer 1: ...``) or copy i alone
    as ``{name_i}``."""
    prompt: Prompt | None = None
    """This node's own prompt template; null: the agent's. An agent that plays two parts in an episode (a
    verifier that first works the problem out, then judges an answer) has one node per part."""
    system: str | None = None
    """This node's own system message; null: the agent's."""
    parser: ParserName | None = None
    """This node's own registered parser; null: the agent's."""
    reward: RewardName | None = None
    """This node's own registered reward; null: the agent's. Each node's samples form their own GRPO groups."""


@dataclass(frozen=True)
class Role:
    """What one node asks of its agent: its prompt template, system message, parser and reward (the node's own
    where it sets them, else the agent's)."""

    agent: str
    prompt: str
    system: str | None
    parser: str
    reward: str

    def template_fields(self) -> set[str]:
        return {f for _, f, _, _ in string.Formatter().parse(self.prompt) if f}


class StopWhen(Strict):
    node: str
    """The loop node whose parsed output can end the loop early (a node without copies)."""
    parsed: str
    """The parsed output that ends the loop, e.g. ``correct`` for the ``verdict`` parser."""


class LoopSpec(Strict):
    nodes: list[str] = Field(min_length=1)
    """The loop's nodes, in the order they run within one turn. An edge between two of them runs within a
    turn when it points forward in this list, and into the next turn when it points backward (self edges
    too): that is how a turn reads the one before."""
    max_turns: int = Field(ge=1, le=32)
    """Most turns: each node of the loop is unrolled into ``name_t0 .. name_t{max_turns-1}``."""
    stop_when: StopWhen | None = None
    """Optional early stop: once ``node`` parses to ``parsed``, the loop's later turns are skipped (not
    generated, no samples)."""


class GraphSpec(Strict):
    nodes: list[NodeSpec] = Field(min_length=1)
    """Agent invocations of one episode (see ``graph.nodes[]``)."""
    edges: list[tuple[str, str]] = []
    """``[parent, child]`` pairs: the child's prompt reads the parent's response as ``{parent}``."""
    loops: list[LoopSpec] = []
    """Cycles unrolled to a bounded number of turns (see ``graph.loops[]``); a cycle not declared here is
    an error."""

    answer: str | None = None
    """The declared node whose output is the team's answer: its latest instance that ran (in a loop, the turn it
    stopped in). null: the last declared node. ``flexmarl evaluate`` scores the team by it."""

    _expanded: ExpandedGraph = PrivateAttr()

    @model_validator(mode="after")
    def _check_structure(self) -> GraphSpec:
        names = [n.name for n in self.nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate node names {duplicates}: give every node its own name")
        seen: set[tuple[str, str]] = set()
        for parent, child in self.edges:
            for end in (parent, child):
                if end not in names:
                    raise ValueError(
                        f"edge [{parent}, {child}] names unknown node {end!r}{did_you_mean(end, names)}; "
                        f"nodes are {names}"
                    )
            if (parent, child) in seen:
                raise ValueError(f"edge [{parent}, {child}] is declared twice in graph.edges; remove one")
            seen.add((parent, child))
        loops = [
            DeclaredLoop(tuple(lp.nodes), lp.max_turns, lp.stop_when.node, lp.stop_when.parsed)
            if lp.stop_when else DeclaredLoop(tuple(lp.nodes), lp.max_turns)
            for lp in self.loops
        ]
        if self.answer is not None and self.answer not in names:
            raise ValueError(f"graph.answer names unknown node {self.answer!r}{did_you_mean(self.answer, names)}; "
                             f"nodes are {names}")
        # raises GraphError (a ValueError) naming the declared nodes
        self._expanded = expand([DeclaredNode(n.name, n.agent, n.copies) for n in self.nodes], self.edges, loops)
        return self

    @property
    def expanded(self) -> ExpandedGraph:
        """The graph the rollout engine runs: copies and loops unrolled (see ``flexmarl.meg.graph``)."""
        return self._expanded

    def answer_node(self) -> str:
        """The declared node whose latest instance gives the team's answer (``answer``)."""
        return self.answer or self.nodes[-1].name

    def answer_agent(self) -> str:
        """The agent of ``answer_node``."""
        return next(n.agent for n in self.nodes if n.name == self.answer_node())

    def parents(self, node: str) -> list[str]:
        """The declared parents of a declared node."""
        return [p for p, c in self.edges if c == node]

    def order(self) -> list[str]:
        """Expanded nodes in a deterministic topological order (ties broken by declaration order)."""
        return self._expanded.order()


class MEGSpec(Strict):
    agents: dict[str, AgentSpec] = Field(min_length=1)
    graph: GraphSpec

    _roles: dict[str, Role] = PrivateAttr()  # by declared node, resolved once: the rollout asks per sample

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
                hint = did_you_mean(node.agent, list(self.agents))
                raise ValueError(
                    f"node {node.name!r} uses unknown agent {node.agent!r}{hint}; agents are {sorted(self.agents)}: "
                    "declare it under agents, or fix the node's agent"
                )
        unused = sorted(set(self.agents) - {n.agent for n in self.graph.nodes})
        if unused:
            raise ValueError(
                f"agents {unused} are declared but no graph node uses them; remove them or add a node to graph.nodes"
            )
        self._roles = {}
        for node in self.graph.nodes:
            agent = self.agents[node.agent]
            self._roles[node.name] = Role(
                node.agent, node.prompt or agent.prompt, node.system if node.system is not None else agent.system,
                node.parser or agent.parser, node.reward or agent.reward)
        return self

    def check_templates(self, problem_fields: set[str]) -> None:
        """Every ``{field}`` of a node's prompt must be a problem field or a declared parent of the node.

        A parent with ``copies: k`` provides ``{parent}`` and ``{parent_0} .. {parent_<k-1>}``. Also checks
        that each agent's reward finds the problem fields it reads.
        """
        for node in self.graph.nodes:
            role = self.declared_role(node.name)
            needed = sorted(REWARD_PROBLEM_FIELDS.get(role.reward, set()) - problem_fields)
            if needed:
                where = f"node {node.name}'s reward" if node.reward else f"agents.{node.agent}.reward"
                raise ValueError(
                    f"{where}: {role.reward!r} reads problem field(s) {needed}, which this data does "
                    f"not provide (it has {sorted(problem_fields)}); use data.dataset: humaneval, or another reward"
                )
        copies = {n.name: n.copies for n in self.graph.nodes}
        for node in self.graph.nodes:
            parents = self.graph.parents(node.name)
            provided = set(parents) | {f"{p}_{i}" for p in parents if copies[p] > 1 for i in range(copies[p])}
            shadowed = sorted(provided & problem_fields)
            if shadowed:
                raise ValueError(
                    f"node {node.name!r} reads parent field(s) {shadowed} that are also problem fields; rename "
                    f"the parent node (problem fields: {sorted(problem_fields)})"
                )
            available = problem_fields | provided
            role = self.declared_role(node.name)
            if role.parser in COMPARING_PARSERS and not parents:
                raise ValueError(
                    f"node {node.name!r}: the parser {role.parser!r} compares the node's result with its first "
                    f"parent's answer, and the node has no parent; add an edge [<answer node>, {node.name}] to "
                    "graph.edges"
                )
            if role.reward in JUDGED_ON_GROUP and role.parser not in COMPARING_PARSERS:
                raise ValueError(
                    f"node {node.name!r}: the reward {role.reward!r} scores the node's result on every answer of its "
                    f"group, which needs a parser that compares it with the answer; set its parser to one of "
                    f"{sorted(COMPARING_PARSERS)}, or its reward to verdict_mixed"
                )
            missing = sorted(role.template_fields() - available)
            if missing:
                hint = did_you_mean(missing[0], sorted(available)) if len(missing) == 1 else ""
                prompt = f"node {node.name}'s prompt" if node.prompt else f"agents.{node.agent}.prompt"
                raise ValueError(
                    f"node {node.name!r} (agent {node.agent!r}): prompt field(s) {missing} are provided by "
                    f"neither the problem nor a parent node{hint}; available: {sorted(available)}; fix "
                    f"{prompt}, or add an edge [<parent>, {node.name}] to graph.edges"
                )

    def declared_role(self, name: str) -> Role:
        """The role of the declared node ``name``: its own prompt, system, parser and reward, else its agent's."""
        return self._roles[name]

    def role(self, node: str) -> Role:
        """The role of an expanded node (a copy or a loop turn plays its declared node's role)."""
        return self.declared_role(self.graph.expanded.node(node).source)

    def nodes_of(self, agent: str) -> list[str]:
        """The expanded nodes that invoke ``agent`` (an early stop may skip some in an episode)."""
        return [n.name for n in self.graph.expanded.nodes if n.agent == agent]
