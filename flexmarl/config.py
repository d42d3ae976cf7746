"""RunConfig: one validated object holding every setting of a run, and the one place configs are loaded.

A run's settings come from exactly one YAML document (a file, or a named preset shipped in
``flexmarl/presets/``) plus ``--set dotted.key=value`` overrides. Each field is documented once, under its
definition, in the component's own config module.

Example:
    >>> cfg = load_config(preset="tiny", overrides=["run.steps=3"])
    >>> cfg.run.steps
    3
"""

from __future__ import annotations

import types
import typing
from collections import Counter
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from flexmarl.cluster.config import ClusterConfig
from flexmarl.configbase import did_you_mean
from flexmarl.meg.spec import MEGSpec
from flexmarl.orchestrator.config import RunLoopConfig
from flexmarl.rollout import config as rollout_settings
from flexmarl.rollout.config import RolloutConfig
from flexmarl.tracking.config import TrackingConfig
from flexmarl.training.config import TrainerConfig
from flexmarl.workloads.datasets import DataConfig
from storage.config import StoreConfig

PRESETS = ("default", "tiny", "fan_out", "copy", "copy_team")
Preset = Literal[PRESETS]  # the same list, as a type: the flow's parameter and the CLI check it

# The settings the training flow offers as typed fields of its run form (parameter -> config key); the flow's
# signature holds the same names with the config fields' types, and ``run_overrides`` turns them into
# ``--set``-style overrides, so the config validates them as it validates everything else.
RUN_FORM_SETTINGS: dict[str, str] = {
    "steps": "run.steps",
    "mode": "run.mode",
    "queries_per_step": "run.queries_per_step",
    "group_size": "run.group_size",
    "max_staleness": "run.max_staleness",
    "lr": "training.lr",
    "loss_type": "training.loss_type",
    "backend": "rollout.backend",
}


def run_overrides(overrides: list[str] | None, dask_address: str | None = None, **settings: Any) -> list[str]:
    """``overrides`` followed by one ``key=value`` per run-form setting given (not None) and the cluster address.

    Raises:
        TypeError: a setting that is not in ``RUN_FORM_SETTINGS``.
    """
    unknown = sorted(set(settings) - set(RUN_FORM_SETTINGS))
    if unknown:
        raise TypeError(f"not run-form settings: {unknown}")
    extra = list(overrides or [])
    extra += [f"{RUN_FORM_SETTINGS[name]}={value}" for name, value in settings.items() if value is not None]
    if dask_address:
        extra.append(f"cluster.address={dask_address}")
    return extra


class ConfigError(ValueError):
    """An invalid config; the message names the source, each bad field and the fix."""


class RunConfig(MEGSpec):
    """Everything a run needs: the graph of agents (``agents``, ``graph``) and each component's settings."""

    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    training: TrainerConfig = TrainerConfig()
    run: RunLoopConfig = RunLoopConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _check_templates(self) -> RunConfig:
        self.check_templates(self.data.fields())
        return self

    @model_validator(mode="after")
    def _check_backend_installed(self) -> RunConfig:
        # Here, the driver's own environment, which a LocalCluster's workers share; workers of another Python
        # (cluster.worker_python) are checked before the run starts (preflight), an existing cluster's not.
        if (self.rollout.backend == "vllm" and self.cluster.worker_python is None
                and not rollout_settings.vllm_installed()):
            raise ValueError(rollout_settings.VLLM_MISSING)
        return self

    @model_validator(mode="after")
    def _check_adapters(self) -> RunConfig:
        if self.training.adapter is not None:
            raise ValueError("training.adapter: an adapter is set per agent; write agents.<name>.adapter instead")
        for agent, spec in self.agents.items():
            if "adapter" in spec.training:
                raise ValueError(f"agents.{agent}.training.adapter: write it as agents.{agent}.adapter")
        if self.rollout.backend == "vllm":
            self._check_vllm_adapters()
        return self

    def _check_vllm_adapters(self) -> None:
        """A worker's vLLM engine of one base serves every adapter agent of that base: they must all fit."""
        vllm = self.rollout.vllm
        per_model = Counter(spec.model for spec in self.agents.values() if spec.adapter is not None)
        for model, n in per_model.items():
            if n > vllm.max_loras:
                raise ValueError(f"{n} adapter agents share the model {model!r}, but one vLLM engine holds "
                                 f"rollout.vllm.max_loras={vllm.max_loras} adapters; set rollout.vllm.max_loras={n}")
        for agent, spec in self.agents.items():
            if spec.adapter is not None and spec.adapter.r > vllm.max_lora_rank:
                raise ValueError(f"agents.{agent}.adapter.r={spec.adapter.r} is above rollout.vllm.max_lora_rank="
                                 f"{vllm.max_lora_rank}; raise max_lora_rank (1, 8, 16, 32, 64, ...) or lower r")

    @model_validator(mode="after")
    def _check_agent_training(self) -> RunConfig:
        for agent, spec in self.agents.items():
            for key in TrainerConfig.RUN_WIDE:
                if key in spec.training:
                    raise ValueError(f"agents.{agent}.training.{key}: {key} is run-wide; set training.{key}")
            try:
                self.trainer_config(agent)
            except ValidationError as exc:
                problems = "; ".join(describe_error(e) for e in exc.errors())
                raise ValueError(f"agents.{agent}.training: {problems}") from None
        return self

    @model_validator(mode="after")
    def _check_trainer_groups(self) -> RunConfig:
        for agent, spec in self.agents.items():
            span = self.trainer_config(agent).max_slots
            where = "agents.{a}.training.max_slots" if "max_slots" in spec.training else "training.max_slots"
            if self.training.slots is not None and span > self.training.slots:
                raise ValueError(f"{where.format(a=agent)}={span} is above training.slots={self.training.slots}: "
                                 f"a trainer group spans at most the run's slots; lower it or raise training.slots")
            if span > 1 and spec.adapter is not None:
                raise ValueError(f"{where.format(a=agent)}={span}: agent {agent!r} trains an adapter, and trainer "
                                 "groups of adapter agents are not built yet; use 1 for it")
        return self

    @model_validator(mode="after")
    def _check_sharded_agents(self) -> RunConfig:
        sharded = [a for a in self.agents if self.trainer_config(a).sharded]
        spans = {a: self.trainer_config(a).max_slots for a in sharded}
        if len(set(spans.values())) > 1:
            named = ", ".join(f"{a} over {k}" for a, k in spans.items())
            raise ValueError(f"sharded agents span different numbers of slots ({named}): the sharded agents of a "
                             "run share one world of ranks (one process group per worker); give them the same "
                             "training.max_slots")
        for agent in sharded:
            if self.agents[agent].adapter is not None:
                raise ValueError(f"agents.{agent}: an adapter agent's trainer is not sharded (its state is small); "
                                 "use training.sharding='none' for it")
        return self

    @model_validator(mode="after")
    def _check_micro_batches(self) -> RunConfig:
        # A micro-batch holds whole GRPO groups (advantages are normalised within one): refuse a size the
        # pipeline would otherwise round, so that ``micro_batch_size`` means what it says (as TRL refuses
        # partial groups per generation batch).
        for agent in self.agents:
            per_query = self.run.group_size * len(self.nodes_of(agent))
            size = self.trainer_config(agent).micro_batch_size
            if size % per_query:
                use = max(per_query, size // per_query * per_query)
                where = ("agents.{a}.training.micro_batch_size" if "micro_batch_size" in self.agents[agent].training
                         else "training.micro_batch_size").format(a=agent)
                other = "" if where.startswith("agents.") else f", or set agents.{agent}.training.micro_batch_size"
                raise ValueError(
                    f"{where}={size} is not a whole number of GRPO groups of agent {agent!r}: one query gives it "
                    f"{per_query} samples (run.group_size={self.run.group_size} x {len(self.nodes_of(agent))} "
                    f"node(s)); use {use} (or another multiple of {per_query}){other}")
        return self

    def trainer_config(self, agent: str) -> TrainerConfig:
        """The agent's trainer settings: ``training`` with the agent's own ``training`` overrides and adapter."""
        spec = self.agents[agent]
        if not spec.training and spec.adapter is None:
            return self.training
        adapter = {"adapter": spec.adapter.model_dump()} if spec.adapter is not None else {}
        return TrainerConfig.model_validate({**self.training.model_dump(), **spec.training, **adapter})

    def samples_per_step(self, agent: str) -> int:
        """The agent's largest global batch: one sample per (query, group member, expanded node of the agent).

        A loop that stops early skips its later turns, so a step may hold fewer samples.
        """
        return self.run.queries_per_step * self.run.group_size * len(self.nodes_of(agent))


def load_config(
    path: str | Path | None = None, *, preset: str | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """Load a config file or a preset (exactly one), apply ``dotted.key=value`` overrides, validate.

    Raises:
        ConfigError: unreadable YAML (with its line), an unknown key (with the nearest valid name), a
            wrong type or value, or a graph error.
    """
    if path is not None and preset is not None:
        raise ConfigError("give a config file or a preset, not both")
    if path is None:
        preset = preset or "default"
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}{did_you_mean(preset, list(PRESETS))}; presets: {PRESETS}")
        source = f"preset {preset!r}"
        text = resources.files("flexmarl.presets").joinpath(f"{preset}.yaml").read_text()
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}; check the path") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"{source}: malformed YAML{where}: {getattr(exc, 'problem', exc)}; fix the YAML syntax there (an unclosed "
            "bracket or quote, a tab, or a key without ': ')"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping of settings (agents:, graph:, ...), got "
            f"{type(raw).__name__}; start from a preset such as flexmarl/presets/tiny.yaml"
        )
    check_renamed(raw, source)
    for item in overrides:
        if (renamed := _renamed(item.partition("=")[0].strip())) is not None:
            raise ConfigError(f"override {item!r}: {renamed}")
        apply_override(raw, item)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [f"  {describe_error(err)}" for err in exc.errors()]
        raise ConfigError(
            f"{source} is not a valid FlexMARL config:\n" + "\n".join(lines)
            + "\n(docs/configuration.md lists every key, its type and its default)"
        ) from None


# Keys that were renamed (old dotted key -> new): an old config gets one line naming the new key, not a list of
# unknown keys. A section's keys keep their names under the new section.
RENAMED: dict[str, str] = {
    "train": "run",  # the run's schedule; `training:` is the trainer's settings
    "rollout.slots_per_worker": "rollout.replicas_per_worker",  # a slot is a training slot; these are replicas
}


def _renamed(key: str) -> str | None:
    """Why ``key`` (dotted) is refused when it, or a section above it, was renamed; None when it was not."""
    for old, new in RENAMED.items():
        if key == old and "." not in old:
            return f"the section '{old}:' is now '{new}:'; rename it (its keys keep their names)"
        if key == old or key.startswith(f"{old}."):
            return f"{old} is now {new}: write {new}{key[len(old):]}"
    return None


def check_renamed(raw: dict, source: str) -> None:
    """Refuse, in one line, a config that uses a renamed key (``RENAMED``)."""
    for old in RENAMED:
        node: object = raw
        for part in old.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            raise ConfigError(f"{source}: {_renamed(old)}")


def apply_override(raw: dict, item: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML (``3`` is an int)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like dotted.key=value")
    *parents, leaf = key.strip().split(".")
    if not all(part.strip() for part in (*parents, leaf)):
        raise ConfigError(f"override {item!r}: the key has an empty part; write dotted.key=value, e.g. run.steps=3")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); quote it, "
            f"e.g. --set '{key}=\"{value}\"'"
        ) from None


def describe_error(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = field_names(err["loc"][:-1])
        return f"{loc}: unknown key{did_you_mean(str(err['loc'][-1]), parent)}; valid keys here: {parent}"
    got = err.get("input")
    # a scalar that failed a type or range check is shown; a whole section (a model validator's input) is not
    if err["type"] != "value_error" and isinstance(got, str | int | float | bool) and len(repr(got)) <= 60:
        return f"{loc}: {msg} (got {got!r})"
    return f"{loc}: {msg}"


def field_names(loc: Sequence[Any]) -> list[str]:
    """The valid keys of the config section at ``loc`` (for 'did you mean' hints)."""
    annotation: Any = RunConfig
    for part in loc:
        annotation = _strip_optional(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if part not in annotation.model_fields:
                return []
            annotation = annotation.model_fields[part].annotation
        else:  # dict[str, X] or list[X]: step into the value type
            args = typing.get_args(annotation)
            annotation = args[-1] if args else None
    annotation = _strip_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sorted(annotation.model_fields)
    return []


def _strip_optional(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def dotted_values(cfg: RunConfig) -> dict[str, object]:
    """Every setting of ``cfg`` as ``dotted.key -> value`` (an empty section counts as one value)."""
    flat: dict[str, object] = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(cfg.model_dump(mode="json"), "")
    return flat


def config_summary(cfg: RunConfig) -> str:
    """A run's config in one line: the agents' models, the data, the schedule (the whole is in config.yaml)."""
    models = ", ".join(f"{a}={s.model}" for a, s in cfg.agents.items())
    data = str(cfg.data.path) if cfg.data.path else cfg.data.dataset
    return (f"models {models}; data {data}; {cfg.run.steps} steps of {cfg.run.queries_per_step} queries x "
            f"{cfg.run.group_size}; mode {cfg.run.mode}")


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run actually used)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
