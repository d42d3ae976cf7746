"""The settings of an agent that trains a LoRA adapter on a shared base model (``agents.<name>.adapter``).

Torch-free, like ``names.py``: reading a run's config must not load torch or peft.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from flexmarl.configbase import Strict


class AdapterConfig(Strict):
    """A LoRA adapter (peft): the agent trains only the adapter; the base model's weights stay frozen.

    Agents whose ``model`` is the same and that have an adapter share one copy of the base in each rollout
    replica and each training slot; weight syncs, state moves and snapshots carry only the adapter's tensors
    and its optimizer state.
    """

    type: Literal["lora"] = "lora"
    """The adapter kind; LoRA is the one supported."""
    r: int = Field(8, ge=1, le=1024)
    """LoRA rank."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling: the update is (alpha / r) * B A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (none at generation)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    """Names (last component) of the base model's linear layers that get an adapter; the attention
    projections of Llama/Qwen-style models by default. Checked against the model before a run starts."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, modules: list[str]) -> list[str]:
        if not modules or not all(m.strip() for m in modules):
            raise ValueError("name at least one linear layer, e.g. [q_proj, v_proj]")
        return modules
