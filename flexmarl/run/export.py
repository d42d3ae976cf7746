"""Export a trained agent as a standalone Hugging Face model directory (``flexmarl export``).

The directory holds ``config.json``, ``generation_config.json`` (the agent's sampling settings),
``model.safetensors``, the tokenizer with its chat template, and ``flexmarl_agent.json`` (where it came from,
and the agent's prompt template, parser and reward). ``transformers`` loads it with ``from_pretrained``, and
vLLM serves it (``vllm serve DIR``), since it is a plain model directory of a supported architecture.

Example:
    >>> export_agent(RunDirectory("runs/tiny"), "solver", "exports/solver")
    ExportedAgent(agent='solver', version=2, path=PosixPath('exports/solver'), source=...)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from flexmarl.run.directory import RunDirectory, RunDirectoryError
from flexmarl.run.layout import CHECKPOINTS_DIR

PROVENANCE_FILE = "flexmarl_agent.json"


@dataclass(frozen=True)
class ExportedAgent:
    agent: str
    version: int
    path: Path
    source: Path  # the checkpoint it was exported from


def export_agent(run: RunDirectory, agent: str, out: str | os.PathLike, *, version: int | None = None) -> ExportedAgent:
    """Write ``agent``'s checkpoint of ``version`` (default: its latest) as a model directory at ``out``.

    Args:
        run: the run directory.
        agent: which agent.
        out: a new or empty directory; it is written whole or not at all.
        version: the policy version to export; it must have a checkpoint.

    Raises:
        RunDirectoryError: an unknown agent (listing the agents), no checkpoint of that version (listing the
            versions available), or an ``out`` that already holds files.
    """
    ckpts = run.checkpoints(agent)
    if not ckpts:
        raise RunDirectoryError(
            f"agent {agent!r} has no checkpoint under {run.path / CHECKPOINTS_DIR / agent}: the run saves one at "
            "its end (train.save_checkpoints); was it interrupted?"
        )
    version = max(ckpts) if version is None else version
    if version not in ckpts:
        raise RunDirectoryError(
            f"agent {agent!r} has no checkpoint of version {version}; versions available: "
            f"{', '.join(str(v) for v in ckpts)} (under {run.path / CHECKPOINTS_DIR / agent})"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunDirectoryError(f"{out} already exists and is not an empty directory: choose a new --out")
    source = ckpts[version]
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written next to its destination and renamed into place, so that a failure leaves no half directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write(run, agent, version, source, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is meant to be shared and served
        # safetensors writes its file private (0600) while config.json follows the umask: give every file
        # config.json's mode, so that whoever may read the config may read the weights
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for path in tmp.iterdir():
            if path.is_file():
                path.chmod(mode)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportedAgent(agent, version, out, source)


def _write(run: RunDirectory, agent: str, version: int, source: Path, out: Path) -> None:
    spec = run.config.agents[agent]
    model = AutoModelForCausalLM.from_pretrained(source)
    tok = AutoTokenizer.from_pretrained(source)
    if not tok.chat_template:
        # the rollout built every prompt with the chat template, so a checkpoint without one is incomplete
        raise RunDirectoryError(f"the checkpoint {source} has no chat template in its tokenizer files")
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=spec.sampling.temperature,
        max_new_tokens=spec.sampling.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model.save_pretrained(out)  # safetensors
    tok.save_pretrained(out)
    report = run.report() or {}
    provenance = {
        "agent": agent,
        "policy_version": version,
        "run_id": report.get("run_id"),
        "run_dir": str(run.path.resolve()),
        "checkpoint": str(source.resolve()),
        "base_model": spec.model,
        "system": spec.system,
        "prompt": spec.prompt,
        "parser": spec.parser,
        "reward": spec.reward,
        "sampling": spec.sampling.model_dump(),
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
