"""`flexmarl report` and `flexmarl export`: what a user keeps after a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.cli_output import console, fail

RunDir = Annotated[Path, typer.Argument(help="Run directory (the --run-dir of `flexmarl train`).")]


def report_command(
    run_dir: RunDir,
    out: Annotated[Optional[Path], typer.Option(help="Folder for pictures and pages (default RUN_DIR/report).")] = None,
) -> None:
    """Per-agent pictures, the worker timeline, report.md and report.html of a run."""
    from flexmarl.report.write import write_report
    from flexmarl.run.directory import RunDirectory, RunDirectoryError
    from storage.store import StoreError

    try:
        files = write_report(RunDirectory(run_dir), out or run_dir / "report")
    except (RunDirectoryError, StoreError, ValueError) as exc:
        fail(str(exc))
    for caption, path in files.pictures.items():
        console.print(f"{caption}: {path}")
    console.print(f"report: {files.markdown}\npage:   {files.html}")


def export_command(
    run_dir: RunDir,
    agent: Annotated[str, typer.Option(help="Which agent.")],
    out: Annotated[Path, typer.Option(help="New or empty folder for the model directory.")],
    version: Annotated[Optional[int], typer.Option(help="Policy version (default: the latest checkpoint).")] = None,
    merge: Annotated[bool, typer.Option(help="An adapter agent: merge its adapter into the base, as a full model.")]
    = False,
) -> None:
    """Write an agent's checkpoint as a Hugging Face model directory (transformers and vLLM load it); an adapter
    agent's as its adapter in peft's format, or merged with --merge."""
    from flexmarl.run.export import export_agent
    from flexmarl.run.directory import RunDirectory, RunDirectoryError

    try:
        done = export_agent(RunDirectory(run_dir), agent, out, version=version, merge=merge)
    except RunDirectoryError as exc:
        fail(str(exc))
    console.print(f"exported {done.agent} v{done.version} from {done.source} to {done.path}")
    if (done.path / "adapter_config.json").exists():
        console.print(f"load it with PeftModel.from_pretrained(base, {str(done.path)!r}) (the base model is named in "
                      "its adapter_config.json), or export it again with --merge for a full model", highlight=False)
    else:
        console.print(f"load it with AutoModelForCausalLM.from_pretrained({str(done.path)!r}), "
                      f"or serve it with `vllm serve {done.path}`", highlight=False)
