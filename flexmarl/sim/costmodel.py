"""The simulator's cost model: what each piece of work costs on the simulated cluster, loaded from a preset YAML.

A preset (``flexmarl/sim/presets/<name>.yaml``) describes a cluster, the models and their costs, the agents
(model, prompt size, response-length distribution), the MEG topology and the workload. Every number in a
shipped preset carries a comment saying where it comes from: a measurement, the paper, or an assumption.

Costs are per device, so that one table serves any layout:

- decode: tokens/s per device as a function of the replica's batch (sequences decoding together); a replica
  of a model spans ``rollout_devices`` devices (tensor parallel), so one decode step of a batch of ``b`` takes
  ``b / (tokens_per_s(b) * rollout_devices)`` seconds;
- prefill: prompt tokens/s per device;
- training: tokens (prompt + response) per second per device, forward and backward;
- state: weights plus optimizer state, which a swap moves between device and host at ``swap_gb_per_s``;
- weight sync: seconds for one rollout engine to receive and load new weights;
- trainer groups (data parallel over several training slots): each rank trains whole micro-batches at the
  training rate of its own slot, and the optimizer step adds a ring all-reduce of the gradients between the
  ranks over ``link_gb_per_s``.

Example:
    >>> preset = load_preset("paper-ma")
    >>> preset.cluster.total_devices
    768
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import Field, ValidationError, model_validator

from flexmarl.configbase import Strict, did_you_mean
from flexmarl.meg.graph import ExpandedGraph
from flexmarl.meg.spec import GraphSpec

PRESETS = ("paper-ma", "paper-ca", "scale-15x14b", "scale-3x32b-7x14b", "scale-5x32b")


class PresetError(ValueError):
    """An invalid simulator preset; the message names the field and the fix."""


class ModelCost(Strict):
    params_b: float = Field(gt=0)
    """Parameters in billions (for the record: the costs below are given directly)."""
    rollout_devices: int = Field(1, ge=1)
    """Devices one rollout replica spans (tensor parallel)."""
    decode_tokens_per_s: dict[int, float]
    """Decode tokens/s per device, keyed by the replica's batch (sequences decoding together). Interpolated
    log-log between the points, flat beyond them."""
    prefill_tokens_per_s: float = Field(gt=0)
    """Prompt tokens processed per second per device."""
    train_tokens_per_s: float = Field(gt=0)
    """Training tokens (prompt + response) per second per device, forward and backward."""
    train_overhead_s: float = Field(0.0, ge=0)
    """Fixed seconds per trained micro-batch (reading it from the store, launching the step)."""
    optimizer_step_s: float = Field(ge=0)
    """Seconds of one optimizer step of this model on its training slot."""
    weights_gb: float = Field(gt=0)
    """Weights in GB, as rollout holds them."""
    state_gb: float = Field(gt=0)
    """Training state in GB: weights plus optimizer state (what a swap or a move carries)."""
    weight_sync_s: float = Field(ge=0)
    """Seconds one rollout engine is busy receiving and loading a new version."""

    @property
    def gradient_gb(self) -> float:
        """GB of gradients a trainer group's ranks all-reduce at each optimizer step: the size of the weights,
        assuming gradients are reduced in the weights' dtype (bf16 in the shipped presets, as their
        ``optimizer_step_s`` assumes for the all-reduce within a slot)."""
        return self.weights_gb

    @model_validator(mode="after")
    def _check_curve(self) -> ModelCost:
        if not self.decode_tokens_per_s:
            raise ValueError("decode_tokens_per_s needs at least one point {batch: tokens/s per device}")
        if any(b < 1 or v <= 0 for b, v in self.decode_tokens_per_s.items()):
            raise ValueError("decode_tokens_per_s: batches must be >= 1 and rates > 0")
        return self

    def step_seconds(self, batch: np.ndarray) -> np.ndarray:
        """Seconds of one decode step of a replica decoding ``batch`` sequences together (vectorised)."""
        points = sorted(self.decode_tokens_per_s.items())
        logb = np.log([b for b, _ in points])
        logv = np.log([v for _, v in points])
        per_device = np.exp(np.interp(np.log(batch), logb, logv))
        return batch / (per_device * self.rollout_devices)


class LengthDist(Strict):
    median: float = Field(1.0, gt=0)
    """Median response length in tokens (log-normal)."""
    sigma: float = Field(0.0, ge=0)
    """Spread of the log-normal (0: every response is ``median`` long); 1.0 gives a long tail."""
    max: int = Field(ge=1)
    """Longest response (the generation limit); longer draws are cut here."""
    empirical: list[int] | None = None
    """Measured lengths to draw from instead of the log-normal (a calibration fills it in)."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.empirical:
            draws = rng.choice(np.asarray(self.empirical, dtype=float), n)
        elif self.sigma:
            draws = rng.lognormal(math.log(self.median), self.sigma, n)
        else:
            draws = np.full(n, self.median)
        return np.clip(np.rint(draws), 1, self.max).astype(np.int64)


class AgentCost(Strict):
    model: str
    """A key of ``models``."""
    prompt_tokens: int = Field(ge=1)
    """Prompt tokens of the agent's own template and the task; its parents' responses are added to it."""
    response: LengthDist
    """Response lengths, drawn per request."""


class Layout(Strict):
    workers: int = Field(ge=1)
    """Rollout workers: device groups that each run one task at a time (like a Dask worker)."""
    devices_per_worker: int = Field(ge=1)
    """Devices of each rollout worker. A model needing fewer runs ``devices // rollout_devices`` data-parallel
    replicas on it, each taking an equal share of a batch."""
    colocated: bool = False
    """True: the rollout workers are also the training slots (rollout and training time-share them, as in
    MARTI/OpenRLHF's colocated mode and this machine's local runtime); the two fields below are ignored."""
    training_slots: int = Field(0, ge=0)
    """Training slots of their own (disaggregated pools, the paper's design); agents bind them on demand."""
    devices_per_slot: int = Field(0, ge=0)
    """Devices of each training slot (an agent's trainer spans them, data parallel)."""

    @property
    def devices(self) -> int:
        own = 0 if self.colocated else self.training_slots * self.devices_per_slot
        return self.workers * self.devices_per_worker + own

    @model_validator(mode="after")
    def _check_training(self) -> Layout:
        if not self.colocated and (self.training_slots < 1 or self.devices_per_slot < 1):
            raise ValueError("a disaggregated layout needs training_slots >= 1 and devices_per_slot >= 1 "
                             "(or set colocated: true)")
        return self


class ClusterCost(Strict):
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    device_memory_gb: float = Field(gt=0)
    swap_gb_per_s: float | None = Field(None, gt=0)
    """Host <-> device bandwidth of one training slot for an agent's state; null: no cost (CPU workers)."""
    move_gb_per_s: float = Field(gt=0)
    """Bandwidth of moving an agent's training state from one slot to another (park there, resume here)."""
    link_gb_per_s: float = Field(25.0, gt=0)
    """Bandwidth of the link between training slots that a trainer group's ranks all-reduce their gradients
    over. The default, 25 GB/s, is one 200 Gb/s RoCE link: the rate the shipped presets assume for weight syncs
    and for the all-reduce within a slot."""
    layout: Layout
    """Where rollout and training run in the flexmarl modes."""
    sync_layout: Layout | None = None
    """The layout of the ``sync`` baseline (MARTI-like); null: the same as ``layout``."""

    @property
    def total_devices(self) -> int:
        return self.nodes * self.devices_per_node


class WorkloadCost(Strict):
    steps: int = Field(10, ge=1)
    """Optimizer steps per agent."""
    queries_per_step: int = Field(ge=1)
    """Task inputs per step (the paper's inter-query parallelism)."""
    group_size: int = Field(ge=1)
    """Samples per input and node (the paper's intra-query parallelism, the GRPO group)."""
    micro_batch_size: int = Field(ge=1)
    """Samples per micro-batch (whole groups: the runtime's ``micro_batch_of``)."""
    max_batch_size: int = Field(ge=1)
    """Most requests one replica takes in one generation batch."""
    replicas_per_worker: int = Field(2, ge=1)
    """Replica slots per rollout worker (``rollout.replicas_per_worker``)."""
    balance_threshold: float = Field(5.0, ge=0)
    """Disparity threshold of the inter-agent balancer (``rollout.balance_threshold``)."""
    balance_cooldown_s: float = Field(1.0, ge=0)
    """Hysteresis of the inter-agent balancer (``rollout.balance_cooldown_s``)."""
    micro_batch_generation: bool = False
    """Pipelined flexmarl cuts generation into micro-batch-sized batches (``rollout.micro_batch_generation``).
    Off in the shipped presets: where decoding is memory-bound, small batches waste the device."""
    batching: Literal["continuous", "static"] = "continuous"
    """'continuous' (vLLM-like): finished sequences leave the batch, the rest decode faster; the batch's results
    return when its last sequence ends. 'static' (Hugging Face generate): every step decodes the whole batch
    until its longest sequence ends."""
    stream_interval_s: float = Field(1.0, ge=0)
    """Continuous batching: a batch's finished sequences return in chunks at most this often (0: each one as
    it ends). Fewer events, so a faster simulation; a second is small against decodes of minutes."""
    seed: int = 0
    """Seeds the response lengths (the same draws in every mode)."""


class DriverCost(Strict):
    task_overhead_s: float = Field(0.0, ge=0)
    """Seconds added to every task (dispatch and result return: about 3 ms for a Dask task here)."""
    commit_s: float = Field(0.0, ge=0)
    """Seconds from a micro-batch's last group to its commit in the store."""


class PaperResult(Strict):
    sync_s: float
    """MARTI's end-to-end seconds per step."""
    flexmarl_s: float
    no_lb_s: float
    """FlexMARL without hierarchical load balancing."""
    no_pipeline_s: float
    """FlexMARL without the micro-batch asynchronous pipeline."""

    def ratios(self) -> dict[str, float]:
        return {
            "speedup_vs_marti": self.sync_s / self.flexmarl_s,
            "lb_ablation": self.no_lb_s / self.flexmarl_s,
            "pipeline_ablation": self.no_pipeline_s / self.flexmarl_s,
        }


class SimPreset(Strict):
    name: str
    description: str
    cluster: ClusterCost
    models: dict[str, ModelCost]
    agents: dict[str, AgentCost]
    graph: GraphSpec
    """The MEG topology, as a run config declares it (``flexmarl.meg.spec``): nodes with copies, edges and
    bounded loops (a simulated loop runs all its turns: nothing is parsed, so no early stop)."""
    workload: WorkloadCost
    driver: DriverCost = DriverCost()
    paper: PaperResult | None = None
    """The paper's end-to-end seconds per step for this workload, when it reports them."""

    @model_validator(mode="after")
    def _check(self) -> SimPreset:
        for name, agent in self.agents.items():
            if agent.model not in self.models:
                raise ValueError(f"agents.{name}.model: unknown model {agent.model!r}"
                                 f"{did_you_mean(agent.model, list(self.models))}; declare it under models")
        used = {n.agent for n in self.graph.nodes}
        for node in self.graph.nodes:
            if node.agent not in self.agents:
                raise ValueError(f"graph node {node.name!r}: unknown agent {node.agent!r}"
                                 f"{did_you_mean(node.agent, list(self.agents))}; declare it under agents")
        unused = sorted(set(self.agents) - used)
        if unused:
            raise ValueError(f"agents {unused} appear in no graph node; add a node or remove them")
        for label, layout in (("layout", self.cluster.layout), ("sync_layout", self.cluster.sync_layout)):
            if layout is not None:
                self._check_layout(label, layout)
        return self

    def _check_layout(self, label: str, layout: Layout) -> None:
        where = f"cluster.{label}"
        if layout.devices > self.cluster.total_devices:
            raise ValueError(f"{where} uses {layout.devices} devices but the cluster has "
                             f"{self.cluster.total_devices} (nodes x devices_per_node); shrink the layout")
        mem = self.cluster.device_memory_gb
        slot_devices = layout.devices_per_worker if layout.colocated else layout.devices_per_slot
        for name, model in self.models.items():
            if model.rollout_devices > layout.devices_per_worker:
                raise ValueError(f"{where}.devices_per_worker={layout.devices_per_worker} but model {name!r} needs "
                                 f"rollout_devices={model.rollout_devices}; give workers more devices")
            if model.weights_gb / model.rollout_devices > mem:
                raise ValueError(f"model {name!r}: {model.weights_gb} GB of weights over {model.rollout_devices} "
                                 f"devices exceed {mem} GB per device; raise rollout_devices")
            if model.state_gb > slot_devices * mem:
                raise ValueError(f"model {name!r}: a training state of {model.state_gb} GB does not fit a training "
                                 f"slot of {slot_devices} x {mem} GB; give {where} bigger slots")

    @property
    def expanded(self) -> ExpandedGraph:
        """The graph with copies unrolled, by the runtime's own expansion (``flexmarl.meg.graph``)."""
        return self.graph.expanded

    def model_of(self, agent: str) -> ModelCost:
        return self.models[self.agents[agent].model]


def load_preset(name_or_path: str | Path) -> SimPreset:
    """A shipped preset by name (``PRESETS``) or a preset YAML file.

    Raises:
        PresetError: an unknown name, an unreadable file or an invalid preset (each field named).
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise PresetError(f"preset file {path} does not exist")
        text, source = path.read_text(), str(path)
    else:
        if str(name_or_path) not in PRESETS:
            raise PresetError(f"unknown simulator preset {str(name_or_path)!r}"
                              f"{did_you_mean(str(name_or_path), list(PRESETS))}; choose from {', '.join(PRESETS)} "
                              "or give a preset YAML file")
        text = resources.files("flexmarl.sim.presets").joinpath(f"{name_or_path}.yaml").read_text()
        source = f"preset {name_or_path}"
    return parse_preset(text, source)


def parse_preset(text: str, source: str = "preset") -> SimPreset:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PresetError(f"{source}: expected a mapping of settings at the top")
    try:
        return SimPreset.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            problems.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        raise PresetError(f"{source}: " + "; ".join(problems)) from None
