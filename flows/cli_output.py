"""Console output shared by the CLI modules."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Print an error and exit with ``code``."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=code)
