"""The base of every config section: unknown keys are errors and assignments re-validate."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments re-validate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
