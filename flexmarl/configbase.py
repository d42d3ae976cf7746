"""The base of every FlexMARL config model: strict, immutable, with helpful suggestions."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors, not silently ignored; a validated config cannot be mutated."""

    # the docstring under each field becomes its description (shown in docs/configuration.md)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def did_you_mean(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
