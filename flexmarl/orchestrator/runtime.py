"""The driver side of a run: the coarse operations the control plane (Prefect tasks) calls.

``prepare_run`` lays out a run directory; a ``Runtime`` then starts the engines on Dask, rolls out a
step, updates an agent and syncs its weights, and saves checkpoints. Each operation takes and returns
small records (versions, counts, metrics), never tensors or tables. The micro-level work (generation
batches, micro-batches) runs inside the engines, on Dask.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from distributed import Client, TimeoutError as DaskTimeoutError

from flexmarl.cluster.local import connect, place
from flexmarl.config import RunConfig, dump_config, load_config
from flexmarl.models.loading import load_tokenizer, resolve_model
from flexmarl.rollout import replica
from flexmarl.rollout.backend import WeightSyncError
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.scoring import episode_rows, sample_rows, score
from flexmarl.training import slot
from flexmarl.workloads.datasets import TaskStream, load_tasks
from storage.store import ExperienceStore

CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class RunContext:
    """What identifies a run: small and picklable, passed between control-plane tasks."""

    run_id: str
    run_dir: str
    store_uri: str
    address: str  # Dask scheduler


@dataclass(frozen=True)
class RolloutSummary:
    step: int
    samples_versions: dict[str, int]  # agent -> Delta version holding the step's samples
    samples: dict[str, int]
    tokens: dict[str, int]
    mean_reward: dict[str, float]
    unparsed: dict[str, int]  # outputs the agent's parser could not read (reward 0)
    failed_episodes: int  # episodes whose reward function raised
    wall_s: float  # sampling and scoring
    store_s: float  # committing the samples and episodes

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class UpdateSummary:
    agent: str
    step: int
    policy_version: int
    samples: int
    tokens: int
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)
    train_s: float = 0.0
    store_s: float = 0.0  # committing the update record
    sync_s: float = 0.0


def prepare_run(cfg: RunConfig, run_dir: str | Path) -> tuple[str, str]:
    """Create the run directory and the store, and write the resolved config. Returns (run_id, store_uri).

    Refuses, before anything runs, a run directory or store that cannot be written.
    """
    run_path = Path(run_dir).resolve()
    try:
        run_path.mkdir(parents=True, exist_ok=True)
        (run_path / CONFIG_FILE).write_text(dump_config(cfg))
    except OSError as exc:
        raise PermissionError(f"cannot write the run directory {run_path}: {exc.strerror}; choose another --run-dir") from None
    store_uri = cfg.store.uri or str(run_path / "store")
    store = ExperienceStore(store_uri, storage_options=cfg.store.storage_options or None)
    store.create(cfg.agents)
    for agent in cfg.agents.values():  # build or convert each model once, before the workers load it
        resolve_model(agent.model, seed=cfg.train.seed)
    return f"{run_path.name}-{uuid.uuid4().hex[:8]}", store_uri


class Runtime:
    """Driver-side handle of one run, cached per process so that every control-plane task shares it."""

    _instances: ClassVar[dict[str, Runtime]] = {}

    @classmethod
    def get(cls, ctx: RunContext) -> Runtime:
        if ctx.run_id not in cls._instances:
            cls._instances[ctx.run_id] = cls(ctx)
        return cls._instances[ctx.run_id]

    @classmethod
    def release(cls, ctx: RunContext) -> None:
        runtime = cls._instances.pop(ctx.run_id, None)
        if runtime is not None:
            runtime.client.close()

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = load_config(Path(ctx.run_dir) / CONFIG_FILE)
        self.store = ExperienceStore.from_config(ctx.store_uri, self.cfg.store)
        self.client: Client = connect(ctx.address, timeout_s=self.cfg.cluster.connect_timeout_s)
        self.model_dirs = {a: str(resolve_model(s.model, seed=self.cfg.train.seed)) for a, s in self.cfg.agents.items()}
        self.tokenizers = {a: load_tokenizer(Path(d)) for a, d in self.model_dirs.items()}
        workers = list(self.client.scheduler_info()["workers"])
        # An agent's replica and trainer share a worker, so that its weight sync stays in one process.
        self.placement = place(list(self.cfg.agents), workers)
        self.versions = {a: self.store.policy_version(a) for a in self.cfg.agents}
        self.tasks = TaskStream(load_tasks(self.cfg.data), seed=self.cfg.data.seed)
        self.timeout_s = self.cfg.rollout.request_timeout_s

    def _result(self, future, what: str):
        try:
            return future.result(timeout=self.timeout_s)
        except (TimeoutError, DaskTimeoutError):
            raise TimeoutError(f"{what} did not finish within {self.timeout_s:.0f}s") from None

    def start_engines(self) -> dict[str, str]:
        """Load every agent's rollout replica and trainer on its worker. Returns agent -> worker."""
        futures = []
        for agent, spec in self.cfg.agents.items():
            opts = dict(workers=[self.placement[agent]], allow_other_workers=False, pure=False)
            version = self.versions[agent]
            futures.append(self.client.submit(replica.start_replica, agent, self.model_dirs[agent], version, **opts))
            futures.append(self.client.submit(
                slot.start_trainer, agent, self.model_dirs[agent], self.cfg.training, spec.sampling.temperature,
                version, **opts,
            ))
        for fut in futures:
            self._result(fut, "starting the engines")
        return dict(self.placement)

    def rollout(self, step: int) -> RolloutSummary:
        """Sample the step's episodes, score them and commit each agent's samples (idempotently)."""
        t0 = time.perf_counter()
        engine = RolloutEngine(
            self.client, self.cfg, self.tokenizers, {a: [w] for a, w in self.placement.items()},
            max_batch_size=self.cfg.rollout.max_batch_size, timeout_s=self.timeout_s, seed=self.cfg.train.seed,
        )
        tasks = self.tasks.batch(step, self.cfg.train.queries_per_step)
        episodes = engine.run(tasks, step=step, group_size=self.cfg.train.group_size)
        score(episodes, self.cfg, adv_eps=self.cfg.training.adv_eps)
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        versions, samples, tokens, rewards, unparsed = {}, {}, {}, {}, {}
        for agent in self.cfg.agents:
            rows = sample_rows(episodes, agent, policy_version=self.versions[agent])
            # seq = step + 1: a retried rollout of this step commits nothing twice
            versions[agent] = self.store.append_samples(agent, rows, app_id=f"rollout:{agent}", seq=step + 1).version
            samples[agent] = rows.num_rows
            tokens[agent] = sum(len(r) for r in rows["response_ids"].to_pylist())
            valid = [r for r in rows["reward"].to_pylist() if r is not None]
            rewards[agent] = sum(valid) / len(valid) if valid else 0.0
            unparsed[agent] = sum(p is None for p in rows["parsed"].to_pylist())
        self.store.append_episodes(episode_rows(episodes), app_id="rollout:episodes", seq=step + 1)
        failed = sum(ep.error is not None for ep in episodes)
        return RolloutSummary(
            step, versions, samples, tokens, rewards, unparsed, failed, wall, time.perf_counter() - t1
        )

    def update(self, agent: str, step: int, samples_version: int) -> UpdateSummary:
        """Train ``agent`` on its step batch, record the update, and sync the new weights to its replica."""
        worker = self.placement[agent]
        opts = dict(workers=[worker], allow_other_workers=False, pure=False)
        t0 = time.perf_counter()
        base = self.versions[agent]
        result = self._result(
            self.client.submit(slot.train_step, agent, self.ctx.store_uri, samples_version, base, **opts),
            f"the update of agent {agent!r} from v{base}",
        )
        train_s = time.perf_counter() - t0
        if result.skipped:
            return UpdateSummary(agent, step, base, 0, result.num_tokens, True, result.metrics, train_s)
        # The consumption record and the version bump are one commit.
        t1 = time.perf_counter()
        self.store.record_update(
            agent, result.policy_version, result.consumed_ids, samples_version=samples_version,
            num_tokens=result.num_tokens, metrics=result.metrics,
        )
        self.versions[agent] = result.policy_version
        t2 = time.perf_counter()
        self.sync_weights(agent, result.policy_version)
        return UpdateSummary(
            agent, step, result.policy_version, len(result.consumed_ids), result.num_tokens, False,
            result.metrics, train_s, t2 - t1, time.perf_counter() - t2,
        )

    def sync_weights(self, agent: str, version: int) -> None:
        """Push the trainer's weights to the agent's replica; fails fast, naming agent, replica and version."""
        worker = self.placement[agent]
        opts = dict(workers=[worker], allow_other_workers=False, pure=False)
        state = self.client.submit(slot.weights, agent, **opts)
        applied = self.client.submit(replica.load_weights, agent, version, state, **opts)
        try:
            got = applied.result(timeout=self.cfg.rollout.request_timeout_s)
        except (TimeoutError, DaskTimeoutError):
            raise WeightSyncError(
                f"weight sync of agent {agent!r} v{version} to replica {worker} timed out"
            ) from None
        if got != version:
            raise WeightSyncError(f"replica {worker} of agent {agent!r} reports v{got} after a sync to v{version}")

    def checkpoint(self, agent: str) -> str:
        out = Path(self.ctx.run_dir) / "checkpoints" / agent / f"v{self.versions[agent]}"
        fut = self.client.submit(
            slot.save_checkpoint, agent, str(out), self.model_dirs[agent],
            workers=[self.placement[agent]], allow_other_workers=False, pure=False,
        )
        return self._result(fut, f"the checkpoint of agent {agent!r}")
