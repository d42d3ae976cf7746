"""Console output shared by the CLI modules."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Print an error and exit with ``code``."""
    print_error(message)
    raise typer.Exit(code=code)


def print_error(message: str) -> None:
    # escape: messages quote YAML such as "[solver, verifier]", which rich would read as markup; soft_wrap:
    # a long path stays whole on one line, so that it can be copied
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
