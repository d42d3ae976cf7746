"""`flexmarl bench ...`: benchmarks that write JSON reports (speed is measured here, never asserted in tests)."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Run a benchmark and write its JSON report.", no_args_is_help=True)
