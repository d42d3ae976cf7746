"""Property: any config document and any ``--set`` overrides either validate or raise ``ConfigError`` with a
message; nothing else escapes (no KeyError, TypeError, YAMLError, ... that the CLI would print as a traceback).

Overrides aim at real keys (every leaf of ``RunConfig``), at near misses and at nonsense, with values of every
YAML kind and some that are not YAML at all. Whole documents are random YAML trees, and the tiny preset with
random subtrees grafted in.
"""

from __future__ import annotations

import typing
from importlib import resources

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from flexmarl.config import ConfigError, RunConfig, _strip_optional, load_config
from flexmarl.workloads.datasets import DataError, check_dataset

TINY = yaml.safe_load(resources.files("flexmarl.presets").joinpath("tiny.yaml").read_text())


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config model; agents as the preset's own names."""
    keys = []
    for name, field in model.model_fields.items():
        ann = _strip_optional(field.annotation)
        if name == "agents":
            for agent in TINY["agents"]:
                keys += leaf_keys(typing.get_args(ann)[1], f"{prefix}agents.{agent}.")
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += leaf_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


KEYS = leaf_keys(RunConfig)
assert len(KEYS) > 60, KEYS  # the walk found the real config, not an empty one

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "tiny", "lots", "6GiB", "0.5", "{question", "{}", "{solver}", "tcp://x:1", "-1",
                     "1e-9", "sync", "flexmarl", "hf", "vllm", "fp16", "bf16", "grpo", "~", ".inf", "[", "{"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)


def misspelt(key: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, len(key) - 1))
    return key[:i] + data.draw(st.sampled_from(["", "x", ".", "..", "_", "=", " "])) + key[i + 1:]


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    out = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["real", "real", "real", "misspelt", "nonsense"]))
        key = draw(st.sampled_from(KEYS))
        if kind == "misspelt":
            key = misspelt(key, draw(st.data()))
        elif kind == "nonsense":
            key = draw(st.text(max_size=15))
        if draw(st.booleans()):
            value = yaml.safe_dump(draw(values), default_flow_style=True, width=10**6).removesuffix("\n...\n")
            value = value.strip()
        else:
            value = draw(st.text(max_size=15))  # raw text: often not YAML
        out.append(key + draw(st.sampled_from(["=", "=", " = ", ""])) + value)
    return out


def graft(draw: st.DrawFn) -> dict:
    """The tiny preset with one random subtree replaced: the errors a hand edit makes."""
    raw = yaml.safe_load(yaml.safe_dump(TINY))
    path = draw(st.sampled_from(KEYS + ["agents", "graph", "graph.nodes", "agents.solver", "data", "train"]))
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = draw(values)
    return raw


documents = st.one_of(
    st.builds(lambda v: yaml.safe_dump(v), values),  # random YAML: lists, scalars, odd mappings
    st.composite(lambda draw: yaml.safe_dump(graft(draw)))(),
    st.text(max_size=40),  # not even YAML
)


def check_outcome(load) -> None:
    try:
        cfg = load()
    except ConfigError as exc:
        message = str(exc)
        assert message.strip() and "Traceback" not in message
        return
    assert isinstance(cfg, RunConfig)
    try:  # the cheap part of what validate checks next: the dataset's name and arguments
        check_dataset(cfg.data)
    except DataError as exc:
        assert str(exc).strip()


FUZZ = settings(max_examples=700, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(overrides())
def test_random_overrides_validate_or_raise_a_config_error(items: list[str]) -> None:
    check_outcome(lambda: load_config(preset="tiny", overrides=items))


@settings(FUZZ, max_examples=400)
@given(text=documents, items=overrides())
def test_random_documents_validate_or_raise_a_config_error(text: str, items: list[str], tmp_path_factory) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_text(text)
    check_outcome(lambda: load_config(path, overrides=items))
