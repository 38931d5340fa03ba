"""The config reference (docs/config.md), written from the pydantic models themselves.

Every section of a run's config gets a table of its fields (type with its bounds, default,
description) and a list of the checks its validators make; a section inside a section gets its own
heading, and a union of sections (weight_sync: one model per transport) gets one heading per member.
The models are the only source: scripts/make_tables.py writes the result into docs/config.md, and a
test fails when the committed page differs. A field without a description, or a validator without a
docstring, is refused here, so the page cannot silently leave one out.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rollfleet.config.models import RunConfig

# pydantic's metadata of Field(ge=..., min_length=...): the attribute each bound lives in, and how it reads
_BOUNDS = (("ge", ">= {}"), ("gt", "> {}"), ("le", "<= {}"), ("lt", "< {}"))
_BOUNDS += (("min_length", "length >= {}"), ("max_length", "length <= {}"))


class UndocumentedConfig(ValueError):
    """A config field without a description, or a validator without a docstring: the reference would be missing it."""


def reference(root: type[BaseModel] = RunConfig) -> str:
    """Markdown for every section under `root`, in the models' order: plain top-level keys first (if
    any), then a heading per section, then the checks of `root`'s own validators."""
    plain = [(name, info) for name, info in root.model_fields.items() if not _section_models(info.annotation)]
    parts = ["## Top-level keys\n", *_rows(root, "", plain)[0]] if plain else []
    for name, info in root.model_fields.items():
        if _section_models(info.annotation):
            parts += _sections(name, info)
    checks = _checks(root)
    if checks:
        parts.append("## Checks across sections\n\n" + "\n".join(f"- {check}" for check in checks) + "\n")
    return "\n".join(parts)


def _sections(path: str, info: FieldInfo) -> list[str]:
    """The heading and body of the section at `path`, then those of the sections inside it."""
    members = _section_models(info.annotation)
    if len(members) > 1:  # a union of sections, told apart by its discriminator
        key = info.discriminator
        head = f"## `{path}`\n\n{_one_line(info.description)} One of the members below, chosen by `{key}`"
        head += f" (default: `{key}: {_default_member(info, key)}`).\n"
        return [head] + [
            part
            for member in members
            for part in _section(path, member, f" ({key}: {member.model_fields[key].default})", key)
        ]
    optional = _allows_none(info.annotation)
    return _section(path, members[0], " (optional; unset: off)" if optional else "")


def _section(path: str, model: type[BaseModel], suffix: str, discriminator: str | None = None) -> list[str]:
    level = "#" * min(path.count(".") + 2 + (discriminator is not None), 4)
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] != discriminator)  # the chooser first
    rows, nested = _rows(model, path, fields)
    lines = [f"{level} `{path}`{suffix}\n", f"{_one_line(model.__doc__)}\n", *rows]
    checks = _checks(model)
    if checks:
        lines.append("Checks:\n\n" + "\n".join(f"- {check}" for check in checks) + "\n")
    for child_path, info in nested:
        lines += _sections(child_path, info)
    return lines


def _rows(model: type[BaseModel], path: str, fields: list[tuple[str, FieldInfo]]) -> tuple[list[str], list]:
    """The table of `fields`, and the (path, field) of each section among them, documented after it."""
    lines, nested = ["| field | type | default | description |\n|---|---|---|---|"], []
    for name, info in fields:
        if info.description is None:
            raise UndocumentedConfig(f"{model.__name__}.{name} has no description (fix: add Field(description=...))")
        if _section_models(info.annotation):
            child = f"{path}.{name}" if path else name
            nested.append((child, info))
            unset = "`null`: off; " if _allows_none(info.annotation) else ""
            kind, default = "section", f"{unset}see `{child}`"
        else:
            kind, default = _type(info.annotation) + _bounds(info), _default(info)
        lines.append(f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(_one_line(info.description))} |")
    lines[-1] += "\n"
    return lines, nested


def _checks(model: type[BaseModel]) -> list[str]:
    """What the model's validators check, from their docstrings (a union's member lists its base's too)."""
    decorators = model.__pydantic_decorators__
    found = []
    for name, decorator in decorators.field_validators.items():
        fields = ", ".join(f"`{field}`" for field in decorator.info.fields)
        found.append(f"{fields}: {_docstring(model, name, decorator.func)}")
    for name, decorator in decorators.model_validators.items():
        found.append(_docstring(model, name, decorator.func))
    return found


def _docstring(model: type[BaseModel], name: str, func: Any) -> str:
    doc = inspect.getdoc(getattr(func, "__func__", func))
    if not doc:
        raise UndocumentedConfig(
            f"{model.__name__}.{name} has no docstring (fix: say in it what the validator checks and why)"
        )
    return _one_line(doc)


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The section models an annotation holds: [Model], [Model] for `Model | None`, the members of a
    union of sections; [] for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if _is_union(annotation):
        return [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _allows_none(annotation: Any) -> bool:
    return _is_union(annotation) and type(None) in get_args(annotation)


def _default_member(info: FieldInfo, key: str) -> str:
    return getattr(info.get_default(call_default_factory=True), key)


def _type(annotation: Any) -> str:
    """A type as a YAML writer reads it: `int`, `'auto' | int`, `list[str]`, `str | null`."""
    if annotation is type(None):
        return "null"
    if get_origin(annotation) is Literal:
        return " | ".join(repr(value) for value in get_args(annotation))
    if _is_union(annotation):
        return " | ".join(_type(member) for member in get_args(annotation))
    origin = get_origin(annotation)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(arg) for arg in get_args(annotation))}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    found = []
    for item in info.metadata:
        found += [text.format(getattr(item, name)) for name, text in _BOUNDS if getattr(item, name, None) is not None]
    return f", {', '.join(found)}" if found else ""


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    value = info.default if info.default_factory is None else info.get_default(call_default_factory=True)
    assert value is not PydanticUndefined
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    """A default as it would be written in the YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_yaml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        return value if value else "''"
    return repr(value)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
