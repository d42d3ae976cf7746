"""Settings of the MEG Store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    uri: str | None = None
    """Store root: a directory or an object-store URI; null puts it in the run directory as 'store/'."""
    storage_options: dict[str, str] = {}
    """Passed to deltalake (credentials, locking provider) for object stores."""
