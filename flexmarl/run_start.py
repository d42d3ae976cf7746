"""The state of a run directory at a start: an earlier start that failed before its first commit, a store to
verify before a resume.

A run writes ``config.yaml`` and creates its (empty) store before its cluster starts, so a start that fails
after that, before any sample is committed, would otherwise block its own directory: a new run there is
refused ("already holds a run") and a resume with the fix is refused too ("cannot change ..."). Such a
directory holds nothing of value: a run's plan (``flexmarl/run/plan.py``) takes it over when
``never_committed`` says so, and ``clear_failed_start`` removes what that start wrote, so the corrected
command just works. A directory with one committed row is never touched.

``check_resumable`` runs the checks of ``flexmarl store verify`` before a resume: a resumed run never trains
on a store that fails them.

Both run under the run directory's lock (``flexmarl.run_lock``), so no live run's files are touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from flexmarl.config import RunConfig
from flexmarl.run.layout import (
    ATTEMPTS_FILE, CHECKPOINTS_DIR, CONFIG_FILE, REPORT_FILE, STATE_DIR, STORE_DIR, store_uri,
)
from storage.store import ExperienceStore, StoreError, error_summary
from storage.verify import verify_store

# What a start writes before its first commit (besides the store); report.json or checkpoints mean it went further.
START_FILES = (CONFIG_FILE, ATTEMPTS_FILE)
START_DIRS = (STATE_DIR,)


class ResumeRefused(RuntimeError):
    """The store of the run to resume fails verify; the message names the problem and the repair."""


def store_uri_of(run_dir: Path) -> str | None:
    """The store of the run in ``run_dir``, from its config.yaml read as plain YAML (no validation, no models)."""
    try:
        raw = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
        uri = (raw.get("store") or {}).get("uri")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return store_uri(uri, run_dir)


def never_committed(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` started but committed nothing: every table of its store is at version 0
    (created, empty), and it wrote no report or checkpoint. Unknown means no."""
    run_dir = Path(run_dir)
    if (run_dir / REPORT_FILE).exists() or (run_dir / CHECKPOINTS_DIR).exists():
        return False
    uri = store_uri_of(run_dir)
    if uri is None:
        return False
    if "://" not in uri and not Path(uri).exists():
        return True  # the start failed before it created the store
    store = ExperienceStore(uri)
    try:
        for table in store.tables():
            if store.open(table).version() > 0:
                return False
    except Exception:  # noqa: BLE001 - an unreadable store is not known to be empty: keep it
        return False
    return True


def clear_failed_start(run_dir: str | Path) -> bool:
    """Remove what a start that committed nothing wrote in ``run_dir``; True if there was such a start.

    Only the files a start writes go (config.yaml, attempts.txt, the empty store when it lies in the run
    directory, state/); anything else in the directory stays.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file() or not never_committed(run_dir):
        return False
    uri = store_uri_of(run_dir)
    inside = run_dir.resolve() / STORE_DIR
    if uri is not None and Path(uri) == inside and inside.is_dir():
        shutil.rmtree(inside)
    for name in START_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in START_FILES:
        (run_dir / name).unlink(missing_ok=True)
    return True


def check_resumable(cfg: RunConfig, run_dir: str | Path) -> None:
    """The store of the run to resume passes ``flexmarl store verify``; otherwise resuming is refused.

    Raises:
        ResumeRefused: naming the first violation, how many there are, and the repair.
    """
    uri = store_uri(cfg.store.uri, run_dir)
    store = ExperienceStore.from_config(uri, cfg.store)
    try:
        violations = verify_store(store, max_staleness=max_staleness(cfg))
    except StoreError as exc:
        raise ResumeRefused(f"cannot resume {run_dir}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - deltalake raises several types for a damaged table
        raise ResumeRefused(f"cannot resume {run_dir}: its store {uri} cannot be read ({error_summary(exc)}); "
                            f"check it with `flexmarl store verify {run_dir}`") from None
    if violations:
        first = violations[0]
        more = f" (and {len(violations) - 1} more: `flexmarl store verify {run_dir}` lists them)" if len(
            violations) > 1 else ""
        repair = ("restore the store from a backup (or that commit file of _delta_log), then resume; "
                  "or start a new run with another --run-dir")
        raise ResumeRefused(
            f"cannot resume {run_dir}: its store fails verify: {first.check} in {first.table}: {first.detail}"
            f"{more}; a resumed run would train on it. {repair[0].upper()}{repair[1:]}"
        )


def max_staleness(cfg: RunConfig) -> int:
    """The largest staleness bound of any agent: what verify must allow for this run's updates."""
    bounds = [a.max_staleness for a in cfg.agents.values() if a.max_staleness is not None]
    return max([cfg.run.max_staleness, *bounds])
