"""The expanded MEG: copies and bounded loops unrolled into the plain acyclic nodes the rollout engine runs.

``expand`` turns the declared graph (``graph.nodes`` with ``copies``, ``graph.edges``, ``graph.loops``) into
an ``ExpandedGraph``. The rules, which docs/meg.md explains with examples:

- A node with ``copies: k`` (k > 1) becomes ``name_0 .. name_{k-1}``; a node in a loop of ``max_turns: T``
  becomes ``name_t0 .. name_t{T-1}`` (both: ``name_2_t1``). Every instance invokes the node's agent.
- An edge ``[a, b]`` connects every instance of ``a`` to every instance of ``b``, except between two nodes
  of the same loop: there it runs within a turn (``a_tN -> b_tN``) when ``a`` comes before ``b`` in the
  loop's ``nodes`` list, and from one turn to the next (``a_tN -> b_tN+1``) otherwise (self edges too).
- A template field ``{a}`` reads the parent ``a``: its response, or for ``copies: k`` all k responses
  numbered ``Answer 1: ...`` (``{a_i}`` reads copy i alone). Inside a loop it reads the instance the edge
  connects (the same turn, or the previous one: empty at turn 0). Outside a loop it reads the latest
  turn that ran, since an early stop may skip the last turns.
- A loop's ``stop_when`` skips every later turn of the loop once its node's parsed output equals the value.

This module is pure: no pydantic, no I/O. Errors are ``GraphError`` and use the declared names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter


class GraphError(ValueError):
    """A graph that cannot be expanded; the message names the declared nodes and the fix."""


@dataclass(frozen=True)
class DeclaredNode:
    name: str
    agent: str
    copies: int = 1


@dataclass(frozen=True)
class DeclaredLoop:
    nodes: tuple[str, ...]
    max_turns: int
    stop_node: str | None = None
    stop_value: str | None = None


@dataclass(frozen=True)
class ParentInput:
    """What the template field ``{source}`` (and ``{source_i}``) of one expanded node reads."""

    source: str  # the parent, as declared
    copies: int  # the parent's copies; 1 renders one response un-numbered
    turns: tuple[tuple[str, ...], ...]  # candidate instances, one tuple (the copies) per turn, oldest first


@dataclass(frozen=True)
class ExpandedNode:
    name: str
    agent: str
    source: str  # the declared node it is an instance of
    copy: int | None  # copy index, when the declared node has copies > 1
    turn: int | None  # loop turn, when the declared node is in a loop
    inputs: tuple[ParentInput, ...]


@dataclass(frozen=True)
class StopRule:
    """When ``node`` parses to ``value``, the ``skip`` nodes (the loop's later turns) do not run."""

    node: str
    value: str
    skip: tuple[str, ...]


class ExpandedGraph:
    """Acyclic nodes and edges, in a deterministic topological order, with template and stop rules."""

    def __init__(self, nodes: list[ExpandedNode], edges: list[tuple[str, str]], stops: list[StopRule]) -> None:
        self.nodes = nodes
        self.edges = edges
        self._by_name = {n.name: n for n in nodes}
        self._parents: dict[str, list[str]] = {n.name: [] for n in nodes}
        self._children: dict[str, list[str]] = {n.name: [] for n in nodes}
        for parent, child in edges:
            self._parents[child].append(parent)
            self._children[parent].append(child)
        self._stops = {s.node: s for s in stops}
        self._order = self._topological_order()

    def node(self, name: str) -> ExpandedNode:
        return self._by_name[name]

    def parents(self, name: str) -> list[str]:
        return list(self._parents[name])

    def children(self, name: str) -> list[str]:
        return list(self._children[name])

    def order(self) -> list[str]:
        """Nodes in topological order, ties broken by declaration order; a node's index is its ``turn``."""
        return list(self._order)

    def instances(self, source: str) -> list[str]:
        return [n.name for n in self.nodes if n.source == source]

    def stop_rules(self) -> list[StopRule]:
        return list(self._stops.values())

    def skipped_after(self, name: str, parsed: str | None) -> tuple[str, ...]:
        """The nodes an early stop skips once ``name`` has produced ``parsed`` (empty when none)."""
        rule = self._stops.get(name)
        if rule is None or parsed != rule.value:
            return ()
        return rule.skip

    def render_fields(self, name: str, texts: Mapping[str, str]) -> dict[str, str]:
        """Template values the node reads from its parents, given the responses of the nodes that ran."""
        values: dict[str, str] = {}
        for inp in self.node(name).inputs:
            # the latest turn with a response: an early stop may have skipped the later ones
            group = next((g for g in reversed(inp.turns) if any(n in texts for n in g)), ())
            if inp.copies == 1:
                values[inp.source] = texts.get(group[0], "") if group else ""
                continue
            copies = [texts.get(n, "") for n in group] if group else [""] * inp.copies
            values[inp.source] = "\n\n".join(f"Answer {i + 1}: {t}" for i, t in enumerate(copies)) if group else ""
            values.update({f"{inp.source}_{i}": t for i, t in enumerate(copies)})
        return values

    def _topological_order(self) -> list[str]:
        position = {n.name: i for i, n in enumerate(self.nodes)}
        sorter = TopologicalSorter({n.name: self._parents[n.name] for n in self.nodes})
        try:
            sorter.prepare()
        except CycleError as exc:
            raise _cycle_error(list(exc.args[1]), self) from None
        order: list[str] = []
        while sorter.is_active():
            ready = sorted(sorter.get_ready(), key=position.__getitem__)
            order.extend(ready)
            sorter.done(*ready)
        return order


def _cycle_error(path: list[str], graph: ExpandedGraph) -> GraphError:
    sources = [graph.node(n).source for n in path]
    in_loop = {n.source for n in graph.nodes if n.turn is not None}
    looped = sorted(set(sources) & in_loop)
    if looped:  # through a loop the declared names repeat, so show the unrolled instances
        outside = sorted(set(sources) - in_loop)
        return GraphError(
            f"the graph has a cycle ({' -> '.join(path)}); a MEG must be acyclic: edges between loop node(s) "
            f"{looped} and {outside} go both ways; add {outside} to that loop's nodes in graph.loops, or drop "
            "one of the edges"
        )
    members = ", ".join(dict.fromkeys(sources))
    return GraphError(
        f"the graph has a cycle ({' -> '.join(sources)}); a MEG must be acyclic: unroll it as a bounded loop, "
        f"with an entry in graph.loops like {{nodes: [{members}], max_turns: 3}} (max_turns: the most turns)"
    )


# (declared node, turn or None) -> the names of its copies in that turn
InstanceGroup = Callable[[str, int | None], tuple[str, ...]]


def sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    """A sample's id: its problem's input, its node's ``turn`` (index in ``ExpandedGraph.order``), its group member."""
    return f"{input_id}_{turn}_{trajectory_id}"


def instance_name(name: str, copy: int | None, turn: int | None) -> str:
    return name + (f"_{copy}" if copy is not None else "") + (f"_t{turn}" if turn is not None else "")


def expand(
    nodes: Sequence[DeclaredNode], edges: Sequence[tuple[str, str]], loops: Sequence[DeclaredLoop] = ()
) -> ExpandedGraph:
    """Unroll copies and loops (the module docstring has the rules).

    Raises:
        GraphError: a cycle outside any loop, an instance name that clashes with a declared node, or a
            stop condition that cannot skip the later turns (each names the declared nodes and the fix).
    """
    declared = {n.name: n for n in nodes}
    loop_of = _check_loops(declared, loops)

    def turns(name: str) -> list[int | None]:
        return list(range(loops[loop_of[name]].max_turns)) if name in loop_of else [None]

    def copies(name: str) -> list[int | None]:
        k = declared[name].copies
        return list(range(k)) if k > 1 else [None]

    def group(name: str, turn: int | None) -> tuple[str, ...]:
        return tuple(instance_name(name, c, turn) for c in copies(name))

    same_turn: dict[tuple[str, str], bool] = {}  # (parent, child) in one loop -> edge within a turn?
    for parent, child in edges:
        if parent in loop_of and loop_of.get(child) == loop_of[parent]:
            order = loops[loop_of[parent]].nodes
            same_turn[(parent, child)] = order.index(parent) < order.index(child)

    expanded: list[ExpandedNode] = []
    new_edges: list[tuple[str, str]] = []
    for node in nodes:
        for turn in turns(node.name):
            inputs = []
            for parent, child in edges:
                if child != node.name:
                    continue
                if (parent, child) in same_turn:
                    source_turn = turn if same_turn[(parent, child)] else turn - 1
                    candidates = (group(parent, source_turn),) if source_turn >= 0 else ()
                else:
                    candidates = tuple(group(parent, t) for t in turns(parent))
                inputs.append(ParentInput(parent, declared[parent].copies, candidates))
            for copy in copies(node.name):
                name = instance_name(node.name, copy, turn)
                expanded.append(ExpandedNode(name, node.agent, node.name, copy, turn, tuple(inputs)))
                new_edges += [(p, name) for inp in inputs for g in inp.turns for p in g]

    _check_unique(expanded)
    stops = [_stop_rules(loop, group) for loop in loops if loop.stop_node is not None]
    graph = ExpandedGraph(expanded, new_edges, [s for rules in stops for s in rules])
    for i, loop in enumerate(loops):
        _check_stop_reaches_next_turn(i, loop, graph, group)
    return graph


def _check_loops(declared: Mapping[str, DeclaredNode], loops: Sequence[DeclaredLoop]) -> dict[str, int]:
    """Returns each looped node's loop index."""
    loop_of: dict[str, int] = {}
    for i, loop in enumerate(loops):
        where = f"graph.loops[{i}]"
        for name in loop.nodes:
            if name not in declared:
                raise GraphError(f"{where}.nodes: unknown node {name!r}; nodes are {list(declared)}")
            if name in loop_of:
                other = "twice in this loop" if loop_of[name] == i else f"also in graph.loops[{loop_of[name]}]"
                raise GraphError(f"{where}.nodes: node {name!r} is {other}; a node belongs to at most one loop")
            loop_of[name] = i
        if loop.stop_node is not None:
            if loop.stop_node not in loop.nodes:
                raise GraphError(
                    f"{where}.stop_when.node: {loop.stop_node!r} is not one of the loop's nodes {list(loop.nodes)}"
                )
            if declared[loop.stop_node].copies > 1:
                raise GraphError(
                    f"{where}.stop_when.node: {loop.stop_node!r} has copies: {declared[loop.stop_node].copies}, "
                    "but a stop condition reads one response: stop on a node without copies (e.g. a verifier "
                    "or an aggregator)"
                )
    return loop_of


def _check_unique(expanded: list[ExpandedNode]) -> None:
    seen: dict[str, ExpandedNode] = {}
    for node in expanded:
        other = seen.get(node.name)
        if other is not None:
            a, b = (other, node) if other.source == other.name else (node, other)
            raise GraphError(f"node {a.source!r} has the name of {_describe(b)}; rename one of them")
        seen[node.name] = node


def _describe(node: ExpandedNode) -> str:
    parts = []
    if node.copy is not None:
        parts.append(f"copy {node.copy}")
    if node.turn is not None:
        parts.append(f"turn {node.turn}")
    return f"{', '.join(parts)} of node {node.source!r} ({node.name})"


def _stop_rules(loop: DeclaredLoop, group: InstanceGroup) -> list[StopRule]:
    rules = []
    for turn in range(loop.max_turns - 1):  # a stop in the last turn has nothing left to skip
        later = tuple(n for t in range(turn + 1, loop.max_turns) for name in loop.nodes for n in group(name, t))
        rules.append(StopRule(group(loop.stop_node, turn)[0], loop.stop_value, later))
    return rules


def _check_stop_reaches_next_turn(index: int, loop: DeclaredLoop, graph: ExpandedGraph, group: InstanceGroup) -> None:
    """An early stop can only skip nodes that have not started: each must wait for the stop node."""
    if loop.stop_node is None or loop.max_turns < 2:
        return
    stop = group(loop.stop_node, 0)[0]
    seen, todo = set(), [stop]
    while todo:  # the stop node's descendants
        for child in graph.children(todo.pop()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    for name in loop.nodes:
        for instance in group(name, 1):
            if instance not in seen:
                raise GraphError(
                    f"graph.loops[{index}].stop_when: turn 1 of node {name!r} does not wait for "
                    f"{loop.stop_node!r} of turn 0, so an early stop could not skip it; add an edge "
                    f"[{loop.stop_node}, {name}] (or a path through the loop's nodes)"
                )
