"""The errors a run config raises: one line per problem, naming the field, its value and the fix."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A run config a user must fix; `problems` holds one line per failing field."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            super().__init__(f"invalid config: {self.problems[0]}")
        else:
            super().__init__("invalid config:\n" + "\n".join(f"  {line}" for line in self.problems))


class FieldProblem(ValueError):
    """Raised inside a validator; says which field is wrong, why, and what to do.

    `field` is dotted and relative to the model that raises (None inside a field
    validator, where pydantic already knows the field and its value).
    """

    def __init__(self, problem: str, fix: str, field: str | None = None, value: Any = None):
        self.problem, self.fix, self.field, self.value = problem, fix, field, value
        head = f"{field}={show(value)}: " if field else ""
        super().__init__(f"{head}{problem} (fix: {fix})")


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
