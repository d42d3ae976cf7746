"""Settings of the MEG Store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# The one default, shared by StoreConfig and ExperienceStore (which does not import pydantic configs).
DEFAULT_COMPACT_AFTER_FILES = 200


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    uri: str | None = None
    """Store root: a directory or an object-store URI; null puts it in the run directory as 'store/'."""
    storage_options: dict[str, str] = {}
    """Passed to deltalake (credentials, locking provider) for object stores."""
    compact_after_files: int = Field(DEFAULT_COMPACT_AFTER_FILES, ge=0)
    """Compact a table right after an append that leaves it with at least this many data files; 0 turns
    automatic compaction off. Every micro-batch commit adds one small file, and opening a table (which every
    append and read does) gets slower as files pile up: 11 ms at first, 60-100 ms after a few hundred
    commits. Compaction (one writer at a time, under a lease) merges them back into one file."""
