"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are refused, so a typo is an error, not an ignored setting."""

    model_config = ConfigDict(extra="forbid")
