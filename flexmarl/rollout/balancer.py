"""Inter-agent load balancing: move rollout replicas from agents with short queues to agents with long ones.

The rollout capacity is a pool of replicas (a replica serves one agent at a time). An agent's load is its
waiting requests per replica it holds. When the most loaded agent's load exceeds the least loaded one's by more
than ``threshold`` requests per replica (the paper's disparity threshold, default 5), one idle replica moves from
the least to the most loaded agent. Two rules keep replicas from flapping back and forth (hysteresis):

- a move must not invert the order: after it, the target's load is still at least the source's;
- an agent that gained a replica gives none back, and one that gave a replica takes none, for ``cooldown_s``.

A move must also add capacity (``adds_capacity``, asked of the caller, who knows where replicas are): a worker
generates ``lanes`` batches at once (one per Dask thread), so a second replica of the target on a one-lane
worker where it already has one only queues behind the first, while the worker the target lacks may idle.

Plain object, no Dask: the pipeline runtime and the simulator ask it the same question on their own clocks.

Example:
    >>> b = InterAgentBalancer(threshold=5, cooldown_s=1.0)
    >>> b.decide(0.0, queue={"planner": 0, "solver": 24}, replicas={"planner": 2, "solver": 2},
    ...          idle={"planner": 2, "solver": 0})
    Move(at=0.0, source='planner', target='solver', source_load=0.0, target_load=12.0)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Replica:
    """A rollout replica: one generation batch at a time on ``worker``, for ``agent`` (replicas move between
    agents; every agent's engine is loaded on its worker)."""

    agent: str
    worker: str
    busy: bool = False


@dataclass(frozen=True)
class Move:
    """One replica moved from agent ``source`` to agent ``target`` at time ``at``."""

    at: float
    source: str
    target: str
    source_load: float  # waiting requests per replica when the move was decided
    target_load: float


@dataclass
class InterAgentBalancer:
    threshold: float = 5.0
    cooldown_s: float = 1.0
    min_replicas: int = 1  # an agent keeps at least this many (0 lets an idle agent give away its last one)
    lanes: int = 1  # batches one worker generates at once (Dask threads); more replicas of an agent there queue
    moves: list[Move] = field(default_factory=list)
    _gained_at: dict[str, float] = field(default_factory=dict)
    _gave_at: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def load(queue: int, replicas: int) -> float:
        """Waiting requests per replica; an agent with work and no replica is infinitely loaded."""
        if replicas == 0:
            return math.inf if queue else 0.0
        return queue / replicas

    def decide(self, now: float, queue: dict[str, int], replicas: dict[str, int], idle: dict[str, int],
               adds_capacity: Callable[[str, str], bool] | None = None) -> Move | None:
        """The replica to move now, or None.

        Args:
            now: the caller's clock (seconds).
            queue: waiting requests per agent.
            replicas: replicas each agent holds.
            idle: of those, how many are not generating (only an idle replica can move).
            adds_capacity: ``(source, target)`` -> whether one of the source's idle replicas is on a worker
                where the target holds none (None: every idle replica would).
        """
        loads = {a: self.load(queue.get(a, 0), replicas[a]) for a in replicas}
        targets = sorted(
            (a for a in loads if queue.get(a, 0) and not self._cooling(self._gave_at, a, now)),
            key=lambda a: (-loads[a], a),
        )
        sources = sorted(
            (a for a in loads
             if idle.get(a, 0) > 0 and replicas[a] > self.min_replicas and not self._cooling(self._gained_at, a, now)),
            key=lambda a: (loads[a], a),
        )
        for target in targets:
            for source in sources:
                if source == target or not loads[target] - loads[source] > self.threshold:
                    continue
                after_target = self.load(queue.get(target, 0), replicas[target] + 1)
                after_source = self.load(queue.get(source, 0), replicas[source] - 1)
                if after_target < after_source:  # the move would invert the imbalance: it would flap back
                    continue
                if adds_capacity is not None and not adds_capacity(source, target):
                    continue
                move = Move(now, source, target, loads[source], loads[target])
                self.moves.append(move)
                self._gained_at[target] = now
                self._gave_at[source] = now
                return move
        return None

    @staticmethod
    def replica_to_move(idle_workers: list[str], held: list[str], outstanding: dict[str, int]) -> int:
        """Which of the source's idle replicas (given by worker) moves: where the target holds the fewest
        replicas (a second one on a worker only queues behind the first), then the worker with the fewest
        tokens outstanding."""
        return min(range(len(idle_workers)),
                   key=lambda i: (held.count(idle_workers[i]), outstanding.get(idle_workers[i], 0), idle_workers[i]))

    def cooldown_ended_between(self, since: float, now: float) -> bool:
        """Did a past move's cooldown end in (since, now]? Then its agents may move again, so an answer given at
        ``since`` may no longer hold."""
        for move in reversed(self.moves):  # in time order: stop at the first that ended before
            end = move.at + self.cooldown_s
            if end <= since:
                return False
            if end <= now:
                return True
        return False

    def _cooling(self, last: dict[str, float], agent: str, now: float) -> bool:
        return agent in last and now - last[agent] < self.cooldown_s


def adds_capacity(replicas: dict[str, list[Replica]], lanes: int, source: str, target: str) -> bool:
    """Would one of ``source``'s idle replicas sit where ``target`` holds fewer replicas than the worker runs
    batches at once (``lanes``)?"""
    held = Counter(r.worker for r in replicas[target])
    return any(not r.busy and held[r.worker] < lanes for r in replicas[source])


def move_replica(replicas: dict[str, list[Replica]], move: Move, outstanding: dict[str, int]) -> Replica:
    """Carry out ``move`` on the replicas held per agent; returns the replica that moved."""
    idle = [r for r in replicas[move.source] if not r.busy]
    rep = idle[InterAgentBalancer.replica_to_move([r.worker for r in idle], [r.worker for r in replicas[move.target]],
                                               outstanding)]
    replicas[move.source].remove(rep)
    rep.agent = move.target
    replicas[move.target].append(rep)
    return rep
