"""The field types and checks every request model of the SGLang protocol shares: UTF-8 text, host
names, float32 values, a null read as the default, and the lenient base model (unknown fields ignored,
as SGLang does; no NaN or infinity)."""

from __future__ import annotations

import math
import re
import struct
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict


def _utf8(value: str) -> str:
    """Text must encode as UTF-8: a lone surrogate ("\\ud800", legal in JSON) would fail the first
    time the server tokenizes, logs or answers with it, possibly long after this request."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{value[max(0, exc.start - 20) : exc.end + 20]!r} has an unpaired surrogate at index {exc.start}, "
            "which UTF-8 cannot encode: send valid Unicode text"
        ) from None
    return value


Utf8Str = Annotated[str, AfterValidator(_utf8)]


_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")


def _host(value: str) -> str:
    """An address that goes into `tcp://HOST:PORT`: anything else breaks torch's rendezvous URL ("" or
    "x?rank=3" fail its asserts, outside the errors a failed join raises)."""
    if not _HOST.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a host name or an IP address: give the address of group rank 0's host "
            "(an IPv6 address in brackets, as [::1])"
        )
    return value


HostStr = Annotated[str, AfterValidator(_host)]


def utf8_texts(value: Any) -> Any:
    """`_utf8` on a str or on each str of a list (fields typed `str | list[str]`: one error, not one per branch)."""
    for item in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(item, str):
            _utf8(item)
    return value


def as_float32(value: float) -> float:
    """`value` as the engine's float32 tensors see it (0.0 for values too small, inf for too large)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


class Lenient(BaseModel):
    # NaN and Infinity are legal in Python's JSON parser, never a meaningful value here
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def null_is_default(fields: Any, nullable: tuple[str, ...] = ()) -> Any:
    """SGLang reads a null field as its default (its SamplingParams.__post_init__ and GenerateReqInput's
    normalize): drop every null but those of `nullable` fields, where null is a value."""
    if not isinstance(fields, dict):
        return fields
    return {key: value for key, value in fields.items() if value is not None or key in nullable}
