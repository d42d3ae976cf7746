"""Training slots, the scheduler's half that binds them: which agent trains where, and when states move.

Agent-centric slots: an agent with training work binds a free slot and keeps it for its step. A bound agent's
next micro-batch runs on its slot. Unbound agents with work take the free slots, the one whose ready work
waited longest first, preferring the slot its state was prefetched to, then the slot that holds its state;
elsewhere its state moves there first (parked by one worker, resumed by the other). Agents still waiting get
their states prefetched to the slots likely to free next. A mixin of ``Scheduler`` (its state, its ledger).
"""

from __future__ import annotations

from flexmarl.orchestrator.tasks import Discard, Finish, MicroBatch, Park, Prefetch, Resume, Train


class TrainingDispatch:
    def _dispatch_training(self) -> None:
        for agent in self._work_stale:  # an agent's work changes only with its own state (or a complete step)
            self._work[agent] = self._training_work(agent)
        self._work_stale.clear()
        work = {a: w for a in self.agents if (w := self._work[a])}
        for agent, (_, mb) in sorted(work.items()):
            bound = self.bound.get(agent)
            if bound is not None:
                self._run_training(agent, bound, mb)
        free = [w for w in self.slots if w not in self.bound.values()]
        waiting = {a: w for a, w in work.items() if self.bound.get(a) is None}
        while free and waiting:
            agent = self.policy.pick_agent({a: w[0] for a, w in waiting.items()})
            _, mb = waiting.pop(agent)
            target = self.policy.pick_slot(free, self.prefetched.get(agent), self.location[agent])
            free.remove(target)
            self.bound[agent] = target
            if target == self.location[agent]:
                self._stay(agent)
                self._run_training(agent, target, mb)
            else:
                self._move_state(agent, target)
        if waiting:
            self._prefetch_states(waiting)

    def _training_work(self, agent: str) -> tuple[float, MicroBatch | None] | None:
        """(ready since, micro-batch to train or None for the optimizer step), or None when nothing is due.

        The policy decides (``training_work``).
        """
        step = self.versions[agent]  # the update to step + 1 consumes step's batch
        if self.blocked[agent] or (agent, step) not in self.micro:
            return None
        return self.policy.training_work(agent, step, self.micro[(agent, step)], self.complete,
                                         queued=self.queued[agent])

    def _slots_by_release(self) -> list[str]:
        """Bound slots, the one likely to free first first: its agent has the fewest micro-batches left."""
        left = {}
        for agent, worker in self.bound.items():
            if worker is not None:
                left[worker] = sum(not m.trained for m in self.micro.get((agent, self.versions[agent]), []))
        return sorted(left, key=lambda w: (left[w], w))

    def _prefetch_states(self, waiting: dict[str, tuple[float, MicroBatch | None]]) -> None:
        """Every slot is bound: read the states of the agents that will bind next into the host memory of the
        slots likely to free first (in the same order), while those slots train. The move then skips the read.
        """
        order, pending = [], {a: w[0] for a, w in waiting.items()}
        while pending:
            order.append(self.policy.pick_agent(pending))
            del pending[order[-1]]
        taken = set(self.prefetched.values())
        slots = [w for w in self._slots_by_release() if w not in taken]
        for agent in order:
            if agent in self.prefetched:
                continue
            if not slots:
                break
            target = slots.pop(0)
            if target == self.location[agent]:
                continue  # its state is already there
            self._park(agent)
            self.prefetched[agent] = target
            self.outbox.append(Prefetch(agent, target))

    def _park(self, agent: str) -> None:
        """Write the agent's state from its worker to the state store, once.

        Its trainer stays on that worker until the state is resumed elsewhere, so a wrong guess of the slot
        that frees first costs only the write when the agent then binds its own slot again.
        """
        if agent not in self.parked:
            self.parked.add(agent)
            self._emit(Park(agent, self.location[agent]))

    def _stay(self, agent: str) -> None:
        """The agent binds the slot that holds its trainer: a parked copy or a read ahead is not needed."""
        self.parked.discard(agent)  # it trains here next, so the copy goes stale (the next park replaces it)
        prefetched = self.prefetched.pop(agent, None)
        if prefetched is not None:
            self.outbox.append(Discard(agent, prefetched))

    def _run_training(self, agent: str, worker: str, mb: MicroBatch | None) -> None:
        self._work_stale.add(agent)
        if mb is not None:
            mb.submitted = True
            self.queued[agent] += 1
            self._emit(Train(agent, worker, mb))
        else:
            self.blocked[agent] = True
            self._emit(Finish(agent, worker, self.versions[agent]))

    def _move_state(self, agent: str, target: str) -> None:
        """Resume the agent's state on ``target``: parked by its old worker (unless it already is), read by
        ``target`` (unless prefetched there)."""
        self._work_stale.add(agent)
        self.blocked[agent] = True
        self._park(agent)
        where = self.prefetched.pop(agent, None)
        if where is not None and where != target:  # the guess of the next free slot was wrong: free that copy
            self.outbox.append(Discard(agent, where))
        self._emit(Resume(agent, target, self.location[agent], where == target))
