"""The base of every config model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are an error, not a silently ignored setting."""

    model_config = ConfigDict(extra="forbid")
