"""Carrying out a run's plan (``plan.py``): the run directory, its config and attempt, and the store.

``prepare`` takes over a start that failed before its first commit, writes the resolved config and one line
of ``attempts.txt`` (the new run id, and the Prefect flow run that started it), and creates the store's
tables (a no-op for a run that has them). The training flow calls it under the lock its plan was made under;
``prepare_run`` plans and prepares in one call, for benchmarks and tests that build their own config.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from flexmarl.config import RunConfig, dump_config
from flexmarl.preflight import RunLocationError
from flexmarl.run.layout import ATTEMPTS_FILE, CONFIG_FILE
from flexmarl.run.plan import RunPlan, plan_config
from flexmarl.run_start import clear_failed_start
from storage.store import ExperienceStore, error_summary


@dataclass(frozen=True)
class PreparedRun:
    run_id: str  # <run directory's name>-<8 hex digits>: one per attempt
    store_uri: str
    took_over: bool  # an earlier start that failed before its first commit was cleared


def prepare(plan: RunPlan, *, started_by: str | None = None) -> PreparedRun:
    """Lay out the run directory of ``plan``. ``started_by`` (a Prefect flow run id) is recorded with the
    attempt, so that a retry of that flow run finds its run.

    Raises:
        RunLocationError: the store's tables cannot be created (an object store's URI or credentials).
    """
    took_over = plan.takes_over and clear_failed_start(plan.run_dir)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"{plan.run_dir.name}-{uuid.uuid4().hex[:8]}"
    (plan.run_dir / CONFIG_FILE).write_text(dump_config(plan.cfg))
    with (plan.run_dir / ATTEMPTS_FILE).open("a") as attempts_file:
        attempts_file.write(f"{run_id}\t{started_by}\n" if started_by else f"{run_id}\n")
    store = ExperienceStore.from_config(plan.store_uri, plan.cfg.store)
    try:
        store.create(plan.cfg.agents)
    except Exception as exc:  # deltalake raises several types (object stores, permissions)
        raise RunLocationError(
            f"cannot create the store's tables under {plan.store_uri}: {error_summary(exc)}; check store.uri and "
            "store.storage_options"
        ) from exc
    return PreparedRun(run_id, plan.store_uri, took_over)


def prepare_run(
    cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, started_by: str | None = None
) -> tuple[str, str]:
    """Plan (``plan_config``: nothing taken over, no verify) and prepare a run of ``cfg`` in ``run_dir``.
    Returns (run_id, store_uri).

    Refuses, before anything is written, a run directory or store that cannot be written, a model or data
    file that cannot be read, and a directory that already holds a run unless ``resume`` (its config then
    comes from ``plan.resume_config``).
    """
    run = prepare(plan_config(cfg, run_dir, resume=resume), started_by=started_by)
    return run.run_id, run.store_uri
