"""Render docs/configuration.md from the config models, so the reference cannot drift from the code.

    python -m flexmarl.config_docs > docs/configuration.md
"""

from __future__ import annotations

import re
import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flexmarl.config import RunConfig
from flexmarl.meg.spec import AgentSpec, GraphSpec, LoopSpec, NodeSpec, StopWhen
from flexmarl.models.adapter_config import AdapterConfig

HEADER = """# Configuration reference

Generated from the config models by `python -m flexmarl.config_docs`; a test fails when this file is stale.
A run reads one YAML document (a file, or a preset from `flexmarl/presets/`) and `--set dotted.key=value`
overrides, e.g. `--set run.steps=10 --set agents.solver.sampling.temperature=0.7`. Unknown keys are errors.
The resolved config of every run is saved as `RUN_DIR/config.yaml`. The range column gives the values a
setting accepts beyond its type (`any`: every value of the type); a value outside it is refused by
`flexmarl validate` and before `flexmarl train` starts anything, naming the setting and the range.
"""


def _type_name(annotation: typing.Any) -> str:
    return _type_text(annotation).replace("|", "\\|")  # a bare | would split the markdown table cell


def _type_text(annotation: typing.Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a type with its validators: the type is what a user writes
        return _type_text(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    name = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return name or re.sub(r"\bflexmarl(\.\w+)+\.(?=[A-Z])", "", str(annotation).replace("typing.", ""))


def value_range(field: FieldInfo) -> str:
    """The values a field accepts beyond its type, from its pydantic constraints: ``>= 1``, ``0 < x <= 2``."""
    bounds = {type(m).__name__: m for m in field.metadata}
    low = (f"{bounds['Ge'].ge} <=" if "Ge" in bounds else f"{bounds['Gt'].gt} <" if "Gt" in bounds else "")
    high = (f"<= {bounds['Le'].le}" if "Le" in bounds else f"< {bounds['Lt'].lt}" if "Lt" in bounds else "")
    parts = []
    if low or high:
        parts.append(" ".join(p for p in (low, "x", high) if p) if low and high else
                     (f"{'>=' if 'Ge' in bounds else '>'} {low.split()[0]}" if low else high))
    if "MinLen" in bounds:
        parts.append(f"at least {bounds['MinLen'].min_length} item(s)")
    if "MaxLen" in bounds:
        parts.append(f"at most {bounds['MaxLen'].max_length} item(s)")
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    if pattern:
        parts.append(f"matches `{pattern}`")
    return ", ".join(f"`{p}`" if not p.startswith("matches") else p for p in parts) or "any"


def section(title: str, model: type[BaseModel], prefix: str) -> list[str]:
    lines = [f"## `{title}`", "", "| key | type | range | default | meaning |", "|---|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((f"{prefix}{name}", ann))
            continue
        default = "required" if field.is_required() else f"`{field.default!r}`"
        doc = " ".join((field.description or "").split())
        lines.append(f"| `{prefix}{name}` | `{_type_name(ann)}` | {value_range(field)} | {default} | {doc} |")
    lines.append("")
    for key, sub in nested:
        lines += section(key, sub, f"{key}.")
    return lines


def render() -> str:
    parts = [HEADER]
    parts += section("agents.<name>", AgentSpec, "agents.<name>.")
    parts += section("agents.<name>.adapter", AdapterConfig, "agents.<name>.adapter.")
    parts += section("graph", GraphSpec, "graph.")
    parts += section("graph.nodes[]", NodeSpec, "")
    parts += section("graph.loops[]", LoopSpec, "")
    parts += section("graph.loops[].stop_when", StopWhen, "stop_when.")
    for name, field in RunConfig.model_fields.items():
        if name not in ("agents", "graph"):
            parts += section(name, field.annotation, f"{name}.")
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
