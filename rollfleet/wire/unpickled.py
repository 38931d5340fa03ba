"""What pickle's C unpickler may reach while it reads a weight payload (rollfleet.wire.serialize's
`safe_loads`), and the walk that settles what it built.

The C unpickler checks nothing but `find_class`: whatever else the stream names it calls (REDUCE,
and INST/OBJ), gives state to (BUILD: `__setstate__`, else the instance's attributes) or makes
(NEWOBJ: any type's `__new__`). So everything a payload can reach while it is read is inert by
construction: a global it names is a token (`Named`: calling it and giving it state are refused;
`Call`: a function it may call; `Rebuild`: a checked rebuild), and what a rebuild makes is held in
a `Rebuilt` until the whole payload is read, so no opcode reaches a live tensor or storage (BUILD
on a tensor runs `Tensor.__setstate__`, whose `set_` ignores the storage's size; SETITEM on one
would write into it). Tokens are not types, so NEWOBJ refuses them. The rest it can reach takes no
state and cannot be called: plain values, dtypes and `torch.Size` (immutable), and the records,
whose state is what they are for (the reader's allowlist names the only types). `settled` then
puts what each token holds in its place, and refuses cycles and deep nesting.
"""

from __future__ import annotations

import pickle
import types
from typing import Any


def refuse(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"refused payload: {what}")


class Named:
    """What the payload gets for a global it names (a function or class), inert: calling it is
    refused (`Rebuild`: the checked rebuild), and so is giving it state (BUILD)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __call__(self, *args: Any) -> Any:  # REDUCE, and INST/OBJ on a non-type
        raise refuse(f"calling {self.value!r}: a payload may call only torch's tensor-rebuild functions")

    def __setstate__(self, state: Any) -> None:  # BUILD
        raise pickle.UnpicklingError(f"refused to set state on {self.value!r}: only metadata records carry state")


class Call(Named):
    """A function the payload may call (torch.Size)."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Any:
        return self.value(*args)


class Rebuilt(Named):
    """A tensor or storage a rebuild made, held (inert) until the whole payload is read."""

    __slots__ = ()


class Rebuild(Named):
    """A checked rebuild function: its arguments' tokens and holders unwrapped (nested ones are
    refused by its checks), its result held in a `Rebuilt`."""

    __slots__ = ()

    def __call__(self, *args: Any) -> Rebuilt:
        return Rebuilt(self.value(*(a.value if isinstance(a, Named) else a for a in args)))


_NESTED_TOO_DEEP = "containers nest more than {} deep: send a flat list of (name, tensor) or buckets"


def settled(payload: Any, leaves: frozenset[type], limit: int) -> Any:
    """`payload` with every token and holder replaced by what it holds (lists, dicts and records in
    place; a tuple or set made again around a replaced item), refusing (pickle.UnpicklingError) a
    cycle or containers nested more than `limit` deep. Objects of a type in `leaves` hold neither.
    Each container is walked once (a shared one is settled once), recursing at most `limit` deep."""
    done: dict[int, tuple[Any, int, Any]] = {}  # id -> (settled, height, the container: keeps its id taken)
    on_path: set[int] = set()

    def settle(obj: Any, depth: int) -> tuple[Any, int]:
        """(obj settled, its height: how many containers lie below it on its longest path)."""
        if isinstance(obj, Named):
            return obj.value, -1
        found = done.get(id(obj))
        if found is None:
            if id(obj) in on_path:
                raise refuse("it contains itself (a cycle): send a plain list or dict")
            if depth > limit:
                raise refuse(_NESTED_TOO_DEEP.format(limit))
            on_path.add(id(obj))
            found = done[id(obj)] = (*_settle_items(obj, leaves, lambda child: settle(child, depth + 1)), obj)
            on_path.discard(id(obj))
        if depth + found[1] > limit:
            raise refuse(_NESTED_TOO_DEEP.format(limit))
        return found[0], found[1]

    try:
        return payload if type(payload) in leaves else settle(payload, 1)[0]
    finally:
        # `settle` refers to itself through its closure: a reference cycle that kept `done`, hence
        # the whole payload, alive after this returned, until a collection of the oldest generation
        # (rare in an engine: rank_zero.py raises the thresholds). A weight push's payload holds
        # the sender's buckets (CUDA IPC): a colocated trainer could not give 4 GiB back before
        # its engine's resume (H100, 2026-12-06). Broken here, the payload goes when its user drops it.
        done.clear()
        settle = None  # noqa: F841  (clears the closure's cell: the function is freed at once)


def _settle_items(obj: Any, leaves: frozenset[type], settle) -> tuple[Any, int]:
    """A container with its items settled (`settle` for each that is not a leaf), and its height."""
    kind = type(obj)
    if kind is dict or kind is types.SimpleNamespace:
        items = obj if kind is dict else vars(obj)
        if leaves.issuperset(map(type, items.values())) and leaves.issuperset(map(type, items)):
            return obj, 0  # a metadata record: nothing below it (checked in C, no Python per item)
        heights, pairs = [-1], []
        for key, value in items.items():
            for item in (key, value):
                if type(item) not in leaves:
                    item, height = settle(item)
                    heights.append(height)
                pairs.append(item)
        if any(key is not old for key, old in zip(pairs[::2], items)):  # a tuple or tensor as a key
            items.clear()
        items.update(zip(pairs[::2], pairs[1::2]))
        return obj, max(heights) + 1
    if kind is not list and kind is not tuple and kind is not set and kind is not frozenset:
        return obj, 0
    if leaves.issuperset(map(type, obj)):
        return obj, 0
    heights, values = [-1], []
    for item in obj:
        if type(item) not in leaves:
            item, height = settle(item)
            heights.append(height)
        values.append(item)
    if kind is list:
        obj[:] = values
    elif any(value is not item for value, item in zip(values, obj)):
        obj = kind(values)
    return obj, max(heights) + 1
