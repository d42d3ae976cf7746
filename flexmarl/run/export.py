"""Export a trained agent as a standalone Hugging Face model directory (``flexmarl export``).

The directory holds ``config.json``, ``generation_config.json`` (the agent's sampling settings),
``model.safetensors``, the tokenizer with its chat template, and ``flexmarl_agent.json`` (where it came from,
and the agent's prompt template, parser and reward). ``transformers`` loads it with ``from_pretrained``, and
vLLM serves it (``vllm serve DIR``), since it is a plain model directory of a supported architecture.

An adapter agent (``agents.<name>.adapter``) is exported as its adapter in peft's format
(``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer and ``flexmarl_agent.json``), which
``PeftModel.from_pretrained(base, DIR)`` loads onto the base model named in ``adapter_config.json``; with
``merge=True`` it is merged into its base and exported as a full model directory like any other.

Example:
    >>> export_agent(RunDirectory("runs/tiny"), "solver", "exports/solver")
    ExportedAgent(agent='solver', version=2, path=PosixPath('exports/solver'), source=...)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from peft import PeftConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from flexmarl.run.directory import RunDirectory, RunDirectoryError
from flexmarl.run.layout import ADAPTER_CONFIG, CHECKPOINTS_DIR

PROVENANCE_FILE = "flexmarl_agent.json"


@dataclass(frozen=True)
class ExportedAgent:
    agent: str
    version: int
    path: Path
    source: Path  # the checkpoint it was exported from


def export_agent(
    run: RunDirectory, agent: str, out: str | os.PathLike, *, version: int | None = None, merge: bool = False
) -> ExportedAgent:
    """Write ``agent``'s checkpoint of ``version`` (default: its latest) as a model directory at ``out``.

    Args:
        run: the run directory.
        agent: which agent.
        out: a new or empty directory; it is written whole or not at all.
        version: the policy version to export; it must have a checkpoint.
        merge: an adapter agent's adapter merged into its base, as a full model directory (default: the
            adapter alone, in peft's format).

    Raises:
        RunDirectoryError: an unknown agent (listing the agents), no checkpoint of that version (listing the
            versions available), an ``out`` that already holds files, or ``merge`` for an agent without adapter.
    """
    ckpts = run.checkpoints(agent)
    if not ckpts:
        raise RunDirectoryError(
            f"agent {agent!r} has no checkpoint under {run.path / CHECKPOINTS_DIR / agent}: the run saves one at "
            "its end (run.save_checkpoints); was it interrupted?"
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
    if merge and not (source / ADAPTER_CONFIG).exists():
        raise RunDirectoryError(f"agent {agent!r} trains its whole model (no adapter): there is nothing to merge; "
                                "export it without --merge")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written next to its destination and renamed into place, so that a failure leaves no half directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write(run, agent, version, source, tmp, merge)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is meant to be shared and served
        # safetensors writes its file private (0600) while the JSON files follow the umask: give every file
        # their mode, so that whoever may read the config may read the weights
        mode = (tmp / PROVENANCE_FILE).stat().st_mode & 0o777
        for path in tmp.iterdir():
            if path.is_file():
                path.chmod(mode)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportedAgent(agent, version, out, source)


def _write(run: RunDirectory, agent: str, version: int, source: Path, out: Path, merge: bool) -> None:
    spec = run.config.agents[agent]
    adapter = (source / ADAPTER_CONFIG).exists()
    if adapter:
        base = AutoModelForCausalLM.from_pretrained(PeftConfig.from_pretrained(source).base_model_name_or_path)
        model = PeftModel.from_pretrained(base, source)
        if merge:
            model = model.merge_and_unload()
    else:
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
    model.save_pretrained(out)  # safetensors; an unmerged adapter agent's: the adapter alone, in peft's format
    if adapter and not merge:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    report = run.report() or {}
    provenance = {
        "agent": agent,
        "policy_version": version,
        "run_id": report.get("run_id"),
        "run_dir": str(run.path.resolve()),
        "checkpoint": str(source.resolve()),
        "base_model": spec.model,
        "adapter": spec.adapter.model_dump() if spec.adapter is not None and not merge else None,
        "system": spec.system,
        "prompt": spec.prompt,
        "parser": spec.parser,
        "reward": spec.reward,
        "sampling": spec.sampling.model_dump(),
        # the parts the agent plays in the graph, where a node sets its own prompt, parser or reward
        "nodes": {n.name: asdict(run.config.declared_role(n.name)) for n in run.config.graph.nodes if n.agent == agent},
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
