"""Several agents' LoRA adapters on one base model in one process (peft's multi-adapter models).

An ``AdapterHost`` holds one base model and the adapter of every agent that runs on it; a rollout replica or
a trainer of an adapter agent is a name in a host. ``active(name)`` makes one adapter the one in use (peft's
``set_adapter``, under the host's lock) for a forward pass. An adapter's tensors, as ``state`` gives them and
``load_state`` takes them, are named as in peft's saved files (no adapter name inside), so the same tensors
move between any two hosts: a trainer's update reaches a replica, a snapshot a rebuilt trainer.

Example:
    >>> host = AdapterHost(model_dir, torch.device("cpu"))
    >>> name = host.add("solver", AdapterConfig(r=8))
    >>> with host.active(name) as model:
    ...     logits = model(input_ids=ids).logits
"""

from __future__ import annotations

import itertools
import threading
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file
from transformers import PreTrainedModel

from flexmarl.models.adapter_config import AdapterConfig
from flexmarl.models.loading import load_model, meta_model, state_reference
from flexmarl.models.names import ModelError

if TYPE_CHECKING:
    from flexmarl.cluster.worker_state import EngineKey

_NAMES = itertools.count(1)  # adapter names are unique in a process: an agent's old and new trainer may overlap


def host_key(engine_key: EngineKey, model_dir: str | Path) -> str:
    """Where a worker keeps the base that an adapter agent's engine of ``engine_key`` shares:
    ``"<run id>/~base:<model dir>"`` (agent names cannot start with '~'), so that the run's release of its
    engines frees it too."""
    return f"{engine_key.run_id}/~base:{model_dir}"


def lora_config(adapter: AdapterConfig, base_dir: str | Path) -> LoraConfig:
    return LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                      target_modules=list(adapter.target_modules), task_type="CAUSAL_LM",
                      base_model_name_or_path=str(base_dir))


def adapter_reference(model_dir: str | Path, adapter: AdapterConfig) -> dict[str, torch.Tensor]:
    """The names and shapes of an adapter's tensors (as ``AdapterHost.state`` names them), as meta tensors:
    what an adapter update must match, for a backend that holds no peft model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
        peft = get_peft_model(meta_model(Path(model_dir)), lora_config(adapter, model_dir))
    return get_peft_model_state_dict(peft)


def write_adapter(out: str | Path, config: LoraConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter directory in peft's format (``adapter_config.json``, ``adapter_model.safetensors``): loadable
    with ``PeftModel.from_pretrained(base, out)``, and by vLLM as a ``LoRARequest``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              out / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    return out


def linear_layers(model_dir: str | Path) -> set[str]:
    """The last name component of every linear layer of the model in ``model_dir`` (reads no weights)."""
    names = {key.rsplit(".", 2)[-2] for key, t in state_reference(Path(model_dir)).items()
             if key.endswith(".weight") and t.dim() == 2 and "embed" not in key}
    return names


def check_adapter_targets(model_dir: str | Path, adapter: AdapterConfig) -> None:
    """Every ``target_modules`` entry names linear layers of the base model.

    Raises:
        ModelError: naming the modules that do not exist and those that do.
    """
    layers = linear_layers(model_dir)
    missing = sorted(set(adapter.target_modules) - layers)
    if missing:
        raise ModelError(
            f"adapter.target_modules {missing} are not linear layers of {model_dir}; its linear layers are "
            f"{sorted(layers)}: list some of those"
        )


class AdapterHost:
    """One frozen base model and the adapters added to it, for one kind of engine (rollout or training).

    Args:
        model_dir: the base model's local directory.
        device: where the base and the adapters live.
    """

    def __init__(self, model_dir: str | Path, device: torch.device) -> None:
        self.model_dir = str(model_dir)
        self.device = device
        self.lock = threading.RLock()  # one adapter in use at a time, whoever runs the forward pass
        self.base: PreTrainedModel = load_model(Path(model_dir)).to(device).requires_grad_(False)
        self.peft: PeftModel | None = None

    @property
    def model(self) -> PreTrainedModel:
        """The base model with the adapters' layers in it (what a forward pass runs)."""
        return self.peft.get_base_model() if self.peft is not None else self.base

    def add(self, agent: str, adapter: AdapterConfig) -> str:
        """Add a freshly initialised adapter for ``agent``; returns its name in this host.

        LoRA's A matrices start random: they are drawn from a generator seeded by the agent's name, so that
        every trainer of the agent starts from the same adapter. B starts at zero, so a new adapter leaves
        the base model's outputs unchanged.
        """
        name = f"{agent}__{next(_NAMES)}"
        config = lora_config(adapter, self.model_dir)
        with self.lock, torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
            torch.manual_seed(zlib.crc32(agent.encode()))
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
            self.peft.to(self.device)
        for p in self.parameters(name).values():
            p.requires_grad_(False)  # trainable only while active (set_adapter), so one agent's pass trains one
        return name

    def remove(self, name: str) -> None:
        with self.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "adapter X was active, now Y is": the next use sets it
            if self.peft is not None and name in self.peft.peft_config:
                self.peft.delete_adapter(name)

    @contextmanager
    def active(self, name: str) -> Iterator[PreTrainedModel]:
        """The model with adapter ``name`` in use (and trainable), for the length of the block."""
        with self.lock:
            self.peft.set_adapter(name)
            yield self.model

    @contextmanager
    def without_adapters(self) -> Iterator[PreTrainedModel]:
        """The bare base model (a KL reference that costs no extra copy)."""
        with self.lock, self.peft.disable_adapter():
            yield self.model

    def parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's own parameters, by name."""
        marker = f".{name}."
        return {n: p for n, p in self.peft.named_parameters() if marker in n}

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors (live, not copies), named as peft saves them."""
        return get_peft_model_state_dict(self.peft, adapter_name=name)

    def load_state(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (as ``state`` names them) into the adapter; names and shapes must match exactly."""
        own = self.state(name)
        if own.keys() != tensors.keys():
            raise ValueError(f"adapter tensors do not match: missing {sorted(own.keys() - tensors.keys())[:3]}, "
                             f"unexpected {sorted(tensors.keys() - own.keys())[:3]}")
        with self.lock, torch.no_grad():
            set_peft_model_state_dict(self.peft, tensors, adapter_name=name)

    def save(self, name: str, out: str | Path) -> Path:
        """Write the adapter in peft's format (``write_adapter``)."""
        return write_adapter(out, self.peft.peft_config[name], self.state(name))
