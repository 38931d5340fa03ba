"""Reading a run config: YAML plus dotted overrides, validated; pydantic's errors rewritten as one
line per problem (`path=value: problem (fix: ...)`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rollfleet.config.errors import ConfigError, FieldProblem
from rollfleet.config.errors import show as _show
from rollfleet.config.models import RunConfig


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read YAML at `path` (or start empty), apply `a.b.c=value` overrides, validate."""
    data = _read_yaml(path) if path else {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value)
    return parse_config(data)


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a plain dict into a RunConfig, raising ConfigError on any problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError([_describe(e) for e in err.errors()]) from err


def _read_yaml(path: str) -> dict[str, Any]:
    with open(path) as file:
        try:
            data = yaml.safe_load(file)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err} (fix: correct the YAML syntax)") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} holds a {type(data).__name__} at the top level "
            f"(fix: make it a mapping with keys {', '.join(RunConfig.model_fields)})"
        )
    return data


def _parse_override(override: str) -> tuple[str, Any]:
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r} has no '=' (fix: write key=value, e.g. rollout.tp_size=2)")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}={raw}: not a YAML value (fix: quote it, e.g. {key}='{raw}')") from err


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set data[a][b][c] = value for key 'a.b.c', refusing keys the models do not have."""
    parts = key.split(".")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the top level"
        if part not in model.model_fields:
            raise ConfigError(
                f"override {key}: unknown key {part!r} at {here} (fix: use one of {', '.join(model.model_fields)})"
            )
        if depth == len(parts) - 1:
            node[part] = value
            return
        section = ".".join(parts[: depth + 1])
        submodel = _submodel(model, part, node.get(part))
        if submodel is None:
            raise ConfigError(f"override {key}: {section} is a value, not a section (fix: write {section}=VALUE)")
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{section}={_show(child)} is not a section (fix: make {section} a mapping of keys)")
        node, model = child, submodel


def _submodel(model: type[BaseModel], key: str, current: Any = None) -> type[BaseModel] | None:
    """The section model of `key`; for a union of sections (weight_sync), the member its
    `transport` names (in `current`, the data so far) or else the default's."""
    field = model.model_fields[key]
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [m for m in get_args(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    if len(members) < 2:  # none, or an optional section (train.lora: LoraTrainConfig | None)
        return members[0] if members else None
    chosen = current.get("transport") if isinstance(current, dict) else None
    for member in members:
        if member.model_fields["transport"].default == chosen:
            return member
    return type(field.get_default(call_default_factory=True))


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The section model at a location like ('rollout', 'sampling'), or None if it is not a section."""
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = _submodel(model, part)
    return model


_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _describe(error: dict[str, Any]) -> str:
    """One line for one pydantic error: `path=value: problem (fix: ...)`."""
    loc, kind, ctx = tuple(error["loc"]), error["type"], error.get("ctx", {})
    cause = ctx.get("error")
    if isinstance(cause, FieldProblem):
        field_loc = loc + tuple(cause.field.split(".")) if cause.field else loc
        value = cause.value if cause.field else error["input"]
        return f"{_path(field_loc)}={_show(value)}: {cause.problem} (fix: {cause.fix})"
    path = _path(loc)
    if kind == "missing":
        return f"{path}: is required (fix: set {path} in the YAML file or pass {path}=VALUE)"
    if kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        problem, fix = f"must be {op} {ctx[bound]}", f"set {path} to a value {op} {ctx[bound]}"
    elif kind == "literal_error":
        problem, fix = f"must be {ctx['expected']}", f"set {path} to {ctx['expected']}"
    elif kind == "extra_forbidden":
        section = _model_at(loc[:-1])
        valid = ", ".join(section.model_fields) if section else "none"
        problem, fix = "unknown key", f"check the spelling; valid keys here: {valid}"
    else:
        problem, fix = _lower_first(error["msg"]), _describe_field(loc)
    return f"{path}={_show(error['input'])}: {problem} (fix: {fix})"


def _describe_field(loc: tuple[str | int, ...]) -> str:
    field_loc = tuple(p for p in loc if isinstance(p, str))
    section = _model_at(field_loc[:-1])
    if section is None or not field_loc or field_loc[-1] not in section.model_fields:
        return f"correct {_path(loc)}"
    info = section.model_fields[field_loc[-1]]
    return f"{_path(field_loc)} takes {_type_name(info.annotation)} ({(info.description or '').rstrip('.')})"


def _type_name(annotation: Any) -> str:
    plain = isinstance(annotation, type) and get_origin(annotation) is None
    return annotation.__name__ if plain else str(annotation).replace("typing.", "")


def _path(loc: Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "config"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]
