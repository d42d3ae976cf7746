"""Output parsers: agent response text -> a value a reward can check, or ``None`` when it does not parse."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
VERDICT = re.compile(r"\b(yes|no|correct|incorrect|wrong|right|true|false|1|0)\b", re.IGNORECASE)
POSITIVE = {"yes", "correct", "right", "true", "1"}


def last_number(text: str) -> str | None:
    """The last number in the text, without thousands separators (``"... = 1,234."`` -> ``"1234"``)."""
    found = NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return canonical_number(value)


def canonical_number(value: str) -> str | None:
    """``"5.0"`` -> ``"5"``, ``"0.50"`` -> ``"0.5"``; ``None`` when it is not a number."""
    try:
        number = float(value.replace(",", ""))
    except ValueError:
        return None
    return str(int(number)) if number.is_integer() else repr(number)


def same_result(text: str, proposed: str | None) -> str | None:
    """A verdict by comparison, for a judge that works the problem out without reading the answer it judges:
    ``"correct"`` when the text's last number is ``proposed`` (the first parent's parsed answer), else
    ``"incorrect"``; ``None`` when the text has no number. SmolLM2-135M cannot tell whether two numbers are equal
    (docs/performance.md, "Learning"), so the comparison is code and the judge learns its own result."""
    own = last_number(text)
    if own is None:
        return None
    return "correct" if own == proposed else "incorrect"


def verdict(text: str) -> str | None:
    """The first verdict word: ``"correct"`` or ``"incorrect"``."""
    match = VERDICT.search(text)
    if match is None:
        return None
    return "correct" if match.group(1).lower() in POSITIVE else "incorrect"


VERDICT_WORD = re.compile(r"\b(yes|no|correct|incorrect|wrong|right)\b", re.IGNORECASE)


def final_verdict(text: str) -> str | None:
    """The last verdict word, for a verifier that reasons before its verdict: ``"23 + 48 = 71. Verdict: no"``
    -> ``"incorrect"``. Unlike ``verdict`` it reads words only, since the reasoning holds numbers (a ``1`` or
    ``0`` in a sum is no verdict)."""
    found = VERDICT_WORD.findall(text)
    if not found:
        return None
    return "correct" if found[-1].lower() in POSITIVE else "incorrect"


DIGIT = re.compile(r"\d")


def first_digit(text: str) -> str | None:
    """The first digit character in the text (``"ab7c3"`` -> ``"7"``)."""
    match = DIGIT.search(text)
    return match.group(0) if match else None


def text(response: str) -> str | None:
    """The response itself, stripped; ``None`` when it is empty (e.g. a planner's plan)."""
    return response.strip() or None


FENCED = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def python_code(response: str) -> str | None:
    """The first fenced code block (```python ... ```), else the whole response; ``None`` when empty.

    Indentation is kept: a function body continuing a HumanEval stub must stay indented.
    """
    match = FENCED.search(response)
    code = match.group(1) if match else response
    return code.rstrip() if code.strip() else None
