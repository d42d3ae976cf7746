"""The driver's data plane: episodes, scoring and store commits, as the scheduler's commands ask.

The scheduler decides when a group is done and which micro-batches to commit; this module holds the episodes
(prompts, results, rewards) and writes the store. A done group is scored in a thread (``REWARD_THREADS``), so
a slow reward (a sandboxed code run waits on its subprocess) leaves the driver's loop free; a commit (or a
step's end) that needs a group still being scored is held back until it is (``RewardGate``).
A run continuing a crashed or stopped one takes the store's
committed samples of untrained steps (``resume.py``): they count as committed, and their results are replayed
into the episodes instead of being generated.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import pyarrow.compute as pc

from flexmarl.config import RunConfig
from flexmarl.orchestrator.records import MicroBatchCommitted
from flexmarl.orchestrator.resume import StoredResult, StoredRollout
from flexmarl.orchestrator.scheduler import Scheduler
from flexmarl.orchestrator.commands import Commit, MicroBatch, Request, StepDone, StoredBatch
from flexmarl.rollout.backend import GenerationResult
from flexmarl.rollout.episodes import Episode, EpisodeGraph
from flexmarl.rollout.scoring import episode_rows, sample_rows, scale_by_agent, score, trainable_samples
from flexmarl.workloads.datasets import ProblemStream
from storage.schema import SampleStatus
from storage.store import ExperienceStore


REWARD_THREADS = 2  # groups scored at once (threads: reward code that waits on a subprocess releases the GIL)


class RewardGate:
    """Commits and step ends go in the scheduler's order, each held back until the groups it needs are scored.

    The executor asks ``held_back(cmd)`` of every command before it carries it out, and carries out
    ``released()`` first on each turn. A commit reads its groups' rewards, and a step's end drops the step's
    episodes, so neither may overtake a scoring; keeping their order keeps the store's commits in the same
    order as when scoring ran inline.
    """

    def __init__(self) -> None:
        self.unscored: dict[tuple[int, int], Future] = {}  # (step, query) -> its group's scoring
        self.held: list[Commit | StepDone] = []  # commands waiting, in the scheduler's order
        self.going: set[int] = set()  # ids of the held commands ``released`` just let go

    def scoring(self, step: int, query: int, fut: Future) -> None:
        self.unscored[(step, query)] = fut

    @property
    def pending(self) -> bool:
        return bool(self.unscored or self.held)

    def held_back(self, cmd: object) -> bool:
        """Hold ``cmd`` back (True) if it is a commit or a step's end that needs a group still being scored, or
        if an earlier one is held (their order stays)."""
        if id(cmd) in self.going:  # let go by ``released``: it must not queue behind the ones after it
            self.going.discard(id(cmd))
            return False
        if isinstance(cmd, (Commit, StepDone)) and (self.held or self._waits(cmd)):
            self.held.append(cmd)
            return True
        return False

    def released(self) -> list[Commit | StepDone]:
        """The held commands that may go now, in their order: up to the first one still waiting."""
        out = []
        while self.held and not self._waits(self.held[0]):
            out.append(self.held.pop(0))
        self.going = {id(c) for c in out}
        return out

    def _waits(self, cmd: Commit | StepDone) -> bool:
        for key, fut in list(self.unscored.items()):
            if fut.done():
                fut.result()  # scoring's own failure fails the run (a reward's error fails only its episode)
                del self.unscored[key]
        if isinstance(cmd, StepDone):
            return any(step == cmd.step for step, _ in self.unscored)
        return any((cmd.step, q) in self.unscored for mb in cmd.batches for q in mb.queries)


class Collector:
    """Episodes and commits of one pipeline run (the only writer of its sample and episode tables)."""

    def __init__(self, cfg: RunConfig, store: ExperienceStore, graph: EpisodeGraph, problems: ProblemStream) -> None:
        self.cfg, self.store, self.graph, self.problems = cfg, store, graph, problems
        self.trainer_cfg = {a: cfg.trainer_config(a) for a in cfg.agents}
        self.episodes: dict[int, list[Episode]] = {}
        self.rewards: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.lags: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.dropped: dict[tuple[str, int], int] = defaultdict(int)  # zero-variance groups, per (agent, step)
        self.replay: dict[str, StoredResult] = {}
        self.store_write_s = 0.0
        self.generated = self.reused = self.tokens = 0
        self.scoring = ThreadPoolExecutor(REWARD_THREADS, thread_name_prefix="rewards")
        self.gate = RewardGate()

    def open(self, from_step: int) -> None:
        """Read where the store's transactions and committed samples stand (before the first step)."""
        self.seq = {a: self._last_seq(f"rollout:{a}", self.store.samples_table(a)) for a in self.cfg.agents}
        self.episode_seq = self._last_seq("rollout:episodes", "episodes")
        self.stored = StoredRollout(self.store, self.cfg.agents, from_step)

    def _last_seq(self, app_id: str, table: str) -> int:
        return self.store.open(table).transaction_version(app_id) or 0

    @contextmanager
    def timing_store(self) -> Iterator[None]:
        """Count the block's time as the driver's time in store writes."""
        start = time.perf_counter()
        yield
        self.store_write_s += time.perf_counter() - start

    # ------------------------------------------------------------------ steps

    def open_step(self, sched: Scheduler, step: int) -> None:
        problems = self.problems.batch(step, self.cfg.run.queries_per_step)
        self.episodes[step] = [Episode(t, j, step) for t in problems for j in range(self.cfg.run.group_size)]
        sched.open_step(step, [t.input_id for t in problems])
        replay: set[str] = set()
        if self.stored:
            results, committed = self.stored.take(step)
            self.replay.update(results)
            replay = set(results)
            for agent, stored in committed.items():
                for mb in sched.training.micro[(agent, step)]:
                    rows = stored.of_inputs(problems[q].input_id for q in mb.queries)
                    if rows.num_rows:  # a micro-batch is committed in one append: some rows means all of them
                        self._mark_committed(sched, mb, rows, stored.version,
                                             consumed=mb.step < sched.versions[mb.agent])
        sched.start_step(step, replay)

    def episode(self, request: Request) -> Episode:
        return self.episodes[request.step][request.episode]

    def record(self, request: Request, prompt_ids: list[int], result: GenerationResult) -> list[str]:
        """Store a node's result in its episode; returns the later loop turns its early stop skipped."""
        ep = self.episode(request)
        before = set(ep.skipped)
        self.graph.record(ep, request.node, prompt_ids, result)  # readiness is the scheduler's
        return sorted(ep.skipped - before)

    def replayed(self, request: Request) -> list[str]:
        stored = self.replay.pop(request.sample_id)
        self.reused += 1
        return self.record(request, stored.prompt_ids, stored.result)

    def score_group(self, step: int, query: int, wake: Callable[[], None]) -> None:
        """Score the group in a thread; ``wake`` is called (from it) once it is scored."""
        g = self.cfg.run.group_size
        fut = self.scoring.submit(score, self.episodes[step][query * g:(query + 1) * g], self.cfg, self.trainer_cfg)
        self.gate.scoring(step, query, fut)
        fut.add_done_callback(lambda _: wake())

    def step_done(self, step: int) -> None:
        episodes = self.episodes.pop(step)
        if step not in self.stored.episode_steps:
            # one episodes commit per step (training does not wait on it); a resumed run's may be stored already
            self.episode_seq += 1
            with self.timing_store():
                self.store.append_episodes(episode_rows(episodes), app_id="rollout:episodes", seq=self.episode_seq)
        if self.replay:  # stored results the step's episodes never reached (none, unless the graph changed)
            for ep in episodes:
                for node in self.graph.order:
                    self.replay.pop(self.graph.sample_id(ep, node), None)

    # ------------------------------------------------------------------ commits

    def commit(self, sched: Scheduler, cmd: Commit) -> list[MicroBatchCommitted]:
        """Append the command's micro-batches to the agent's sample table; returns what was committed."""
        episodes = self.episodes[cmd.step]
        g = self.cfg.run.group_size
        if cmd.whole_batch:  # agent-wise normalisation over the agent's whole batch
            scale_by_agent([o for ep in episodes for o in ep.outputs.values() if o.agent == cmd.agent],
                           eps=self.trainer_cfg[cmd.agent].adv_eps)
        done = []
        for mb in cmd.batches:
            if mb.committed:  # restored from the store (a resumed run): committing again would duplicate it
                continue
            rows = sample_rows([e for q in sorted(mb.queries) for e in episodes[q * g:(q + 1) * g]], mb.agent)
            self.seq[mb.agent] += 1
            with self.timing_store():
                commit = self.store.append_samples(mb.agent, rows, app_id=f"rollout:{mb.agent}",
                                                   seq=self.seq[mb.agent])
            self._mark_committed(sched, mb, rows, commit.version, consumed=False)
            done.append(MicroBatchCommitted(mb.agent, mb.step, rows.num_rows, len(mb.stored.sample_ids),
                                            commit.version))
        return done

    def _mark_committed(self, sched: Scheduler, mb: MicroBatch, rows, version: int, *, consumed: bool) -> None:
        """The rows of ``mb`` are in the store at ``version``: what its trainer reads, and the update's stats."""
        ids: list[str] = []
        if not consumed:
            rewarded = rows.filter(pc.field("status") == SampleStatus.REWARDED.value)
            # dynamic sampling: groups without reward variance stay in the store but are not trained on
            trained, dropped = trainable_samples(rewarded,
                                                 dynamic_sampling=self.trainer_cfg[mb.agent].dynamic_sampling)
            ids = trained["sample_id"].to_pylist()
            self.rewards[(mb.agent, mb.step)] += rewarded["reward"].to_pylist()
            self.lags[(mb.agent, mb.step)] += [mb.step - v for v in trained["policy_version"].to_pylist()]
            self.dropped[(mb.agent, mb.step)] += dropped
        sched.committed(mb, time.time(), StoredBatch(version, tuple(ids)), trainable=bool(ids), consumed=consumed)

    def update_stats(self, agent: str, step: int) -> tuple[float | None, float, int]:
        """(mean reward of the step's samples, mean staleness of those consumed, zero-variance groups dropped)
        of the agent's update of ``step``."""
        rewards = self.rewards.pop((agent, step), [])
        lags = self.lags.pop((agent, step), [])
        dropped = self.dropped.pop((agent, step), 0)
        return (sum(rewards) / len(rewards) if rewards else None), (sum(lags) / len(lags) if lags else 0.0), dropped
