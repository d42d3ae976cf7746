"""Settings of the MEG Store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# The defaults, shared by StoreConfig and ExperienceStore.
DEFAULT_COMPACT_AFTER_FILES = 200
DEFAULT_CHECKPOINT_INTERVAL = 10


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    uri: str | None = None
    """Store root: a directory or an object-store URI; null puts it in the run directory as 'store/'."""
    storage_options: dict[str, str] = {}
    """Passed to deltalake (credentials, locking provider) for object stores."""
    compact_after_files: int = Field(DEFAULT_COMPACT_AFTER_FILES, ge=0)
    """Compact a table right after an append that leaves it with at least this many data files; 0 turns
    automatic compaction off. Every micro-batch commit adds one small file. Each file makes checkpoints
    larger and reads slower (a reader builds its file list from them), so without compaction appends slow
    from about 20 ms to 50 ms over 1,000 commits. Compaction (one compactor at a time, under a lease) merges
    the files into one."""
    checkpoint_interval: int = Field(DEFAULT_CHECKPOINT_INTERVAL, ge=1)
    """Delta writes a checkpoint of a table every this many commits (the table property
    delta.checkpointInterval, set when the store creates the table). Every append and read opens the table
    and replays the commits made since the last checkpoint; at Delta's default of 100, that replay alone
    grows to about 30 ms."""
