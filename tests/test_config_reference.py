"""The config reference (docs/config.md): generated from the models, complete, and committed up to date."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field, field_validator, model_validator

from rollfleet.config import RunConfig
from rollfleet.config.reference import UndocumentedConfig, reference
from rollfleet.config.section import Section

REPO = Path(__file__).resolve().parent.parent


def _make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", REPO / "scripts" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_config_reference_is_generated_from_the_models():
    text = (REPO / "docs" / "config.md").read_text()
    assert "<!-- table:config-reference -->" in text
    assert _make_tables().render(text, []) == text, "docs/config.md is out of date: run python scripts/make_tables.py"


def _tables(markdown: str) -> dict[str, set[str]]:
    """Each heading's table, as the set of field names in its rows."""
    found, heading = {}, None
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line
            found[heading] = set()
        match = re.match(r"\| `(\w+)` \|", line)
        if match:
            found[heading].add(match.group(1))
    return {h: names for h, names in found.items() if names}


def test_every_section_of_the_run_config_has_a_table_of_all_its_fields():
    # pydantic's JSON schema is an independent list of the sections (one $def per model) and their fields
    schema = RunConfig.model_json_schema()
    wanted = sorted(sorted(d["properties"]) for d in schema["$defs"].values())
    got = sorted(sorted(names) for names in _tables(reference()).values())
    assert got == wanted


class _Inner(Section):
    """Inner doc."""

    depth: int = Field(3, ge=1, le=9, description="How deep.")


class _Alpha(Section):
    """Alpha member."""

    kind: Literal["alpha"] = Field("alpha", description="Selects alpha.")
    size: float = Field(0.5, gt=0, description="Alpha's size | with a pipe.")


class _Beta(Section):
    """Beta member."""

    kind: Literal["beta"] = Field("beta", description="Selects beta.")
    names: list[str] = Field(default_factory=lambda: ["x"], min_length=1, description="Beta's names.")


class _Root(Section):
    """Root."""

    inner: _Inner = Field(default_factory=_Inner, description="An inner section.")
    maybe: _Inner | None = Field(None, description="An optional section.")
    pick: Annotated[_Alpha | _Beta, Field(discriminator="kind")] = Field(default_factory=_Beta, description="A union.")
    mode: Literal["auto"] | int = Field("auto", description="Auto or a count.")
    name: str = Field(description="A required name.")

    @field_validator("mode")
    @classmethod
    def _mode_is_positive(cls, mode):
        """mode is auto or positive."""
        return mode

    @model_validator(mode="after")
    def _check_pair(self):
        """inner and maybe agree."""
        return self


def test_reference_renders_types_bounds_defaults_unions_and_checks():
    text = reference(_Root)
    assert "## `inner`\n\nInner doc." in text
    assert "| `depth` | int, >= 1, <= 9 | `3` | How deep. |" in text
    assert "## `maybe` (optional; unset: off)" in text
    assert text.startswith("## Top-level keys\n")  # the root's plain fields; its sections get headings
    assert "| `mode` | 'auto' \\| int | `auto` | Auto or a count. |" in text
    assert "| `name` | str | **required** | A required name. |" in text and "| `maybe` |" not in text
    assert "## `pick`\n\nA union. One of the members below, chosen by `kind` (default: `kind: beta`)." in text
    assert "### `pick` (kind: alpha)\n\nAlpha member." in text and "### `pick` (kind: beta)" in text
    assert "| `size` | float, > 0 | `0.5` | Alpha's size \\| with a pipe. |" in text
    assert "| `names` | list[str], length >= 1 | `[x]` | Beta's names. |" in text
    assert "## Checks across sections\n\n- `mode`: mode is auto or positive.\n- inner and maybe agree." in text


def test_plain_fields_of_the_root_and_sections_in_sections_are_listed():
    class Outer(Section):
        """Outer doc."""

        inner: _Inner = Field(default_factory=_Inner, description="Nested.")
        flag: bool = Field(True, description="A flag.")
        tags: dict = Field(default_factory=dict, description="Tags.")

    class Root(BaseModel):
        outer: Outer = Field(description="Outer.")

    text = reference(Root)
    assert "| `inner` | section | see `outer.inner` | Nested. |" in text
    assert "| `flag` | bool | `true` | A flag. |" in text and "| `tags` | dict | `{}` | Tags. |" in text
    assert text.index("## `outer`") < text.index("### `outer.inner`")


def test_a_field_without_description_or_a_validator_without_docstring_is_refused():
    class NoDescription(Section):
        """Doc."""

        size: int = 1

    class Root(BaseModel):
        part: NoDescription = Field(description="Part.")

    with pytest.raises(UndocumentedConfig, match="NoDescription.size has no description"):
        reference(Root)

    class Silent(Section):
        """Doc."""

        size: int = Field(1, description="Size.")

        @model_validator(mode="after")
        def _check_size(self):
            return self

    class Root2(BaseModel):
        part: Silent = Field(description="Part.")

    with pytest.raises(UndocumentedConfig, match="Silent._check_size has no docstring"):
        reference(Root2)
