"""A run directory after the run: where its config, report, timeline, store and checkpoints are.

``flexmarl report``, ``export`` and ``store query`` read a finished (or running) run through this one class,
on the layout of ``layout.py``. It imports neither Dask nor torch (a test checks it): the tokenizer, the one
part that needs transformers, is loaded on demand.

Example:
    >>> run = RunDirectory("runs/tiny")
    >>> run.checkpoints("solver")
    {2: PosixPath('runs/tiny/checkpoints/solver/v2')}
"""

from __future__ import annotations

import json
import os
import re
from functools import cached_property
from pathlib import Path

from typing import TYPE_CHECKING

from flexmarl.config import ConfigError, RunConfig, load_config
from flexmarl.orchestrator.records import PipelineResult
from flexmarl.run.layout import (
    ADAPTER_CONFIG, CHECKPOINTS_DIR, CONFIG_FILE, MODEL_CONFIG, REPORT_FILE, STORE_DIR, TIMELINE_FILE,
)
from flexmarl.run.timeline_file import read_timeline
from storage.store import ExperienceStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
_VERSION_DIR = re.compile(r"v(\d+)")


class RunDirectoryError(ValueError):
    """A path that is not a usable run directory, or a part of it that is missing; says what to do."""


class RunDirectory:
    """Read access to one run directory.

    Args:
        path: the run directory (what ``flexmarl train --run-dir`` was given).

    Raises:
        RunDirectoryError: ``path`` does not exist or holds no ``config.yaml``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise RunDirectoryError(f"{self.path} is not a directory: give the --run-dir of a FlexMARL run")
        if not (self.path / CONFIG_FILE).is_file():
            raise RunDirectoryError(
                f"{self.path} has no {CONFIG_FILE}: give a run directory (the --run-dir of `flexmarl train`), "
                "not its store or checkpoints folder"
            )

    @cached_property
    def config(self) -> RunConfig:
        """The resolved config the run used."""
        try:
            return load_config(self.path / CONFIG_FILE)
        except ConfigError as exc:
            raise RunDirectoryError(f"the run's config cannot be loaded: {exc}") from None

    @property
    def store_uri(self) -> str:
        return self.config.store.uri or str((self.path / STORE_DIR).resolve())

    @cached_property
    def store(self) -> ExperienceStore:
        return ExperienceStore.from_config(self.store_uri, self.config.store)

    def report(self) -> dict | None:
        """``report.json``, or None when the run has not finished."""
        path = self.path / REPORT_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def timeline(self) -> PipelineResult | None:
        """The saved worker spans and update events, or None for a run without ``timeline.json``."""
        path = self.path / TIMELINE_FILE
        return read_timeline(path) if path.is_file() else None

    def check_agent(self, agent: str) -> None:
        if agent not in self.config.agents:
            agents = ", ".join(self.config.agents)
            raise RunDirectoryError(f"no agent {agent!r} in the run {self.path}; agents: {agents}")

    def checkpoints(self, agent: str) -> dict[int, Path]:
        """The agent's saved checkpoints by policy version, in version order."""
        self.check_agent(agent)
        root = self.path / CHECKPOINTS_DIR / agent
        found = {}
        for d in root.iterdir() if root.is_dir() else []:
            m = _VERSION_DIR.fullmatch(d.name)
            if m and ((d / MODEL_CONFIG).is_file() or (d / ADAPTER_CONFIG).is_file()):
                found[int(m.group(1))] = d
        return dict(sorted(found.items()))

    def tokenizer(self, agent: str) -> PreTrainedTokenizerBase:
        """The agent's tokenizer: from its latest checkpoint (a copy of the model's), else from its model.

        Raises:
            RunDirectoryError: neither a checkpoint nor the model named in the config can be found.
        """
        from flexmarl.models.loading import ModelError, load_tokenizer, resolve_model  # torch: on demand

        ckpts = self.checkpoints(agent)
        if ckpts:
            return load_tokenizer(ckpts[max(ckpts)])
        model = self.config.agents[agent].model
        try:
            return load_tokenizer(resolve_model(model, seed=self.config.run.seed))
        except ModelError as exc:
            raise RunDirectoryError(f"no tokenizer for agent {agent!r}: no checkpoint was saved, and {exc}") from None
