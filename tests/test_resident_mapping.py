"""The resident path's sender-side bookkeeping (rollfleet.weights.transports.resident): which engines
get the tensors, when the id changes, and when the source is walked again. The path end to end
(engines, fleets, the loop) is in test_weight_sync.py and test_grpo_loop.py."""

from __future__ import annotations

import torch

from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports.resident import ResidentMapping
from rollfleet.wire.serialize import safe_loads


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _decoded(entries: dict) -> dict:
    return {engine: [safe_loads(e) for e in per_rank] for engine, per_rank in entries.items()}


def test_tensors_go_where_the_engine_does_not_hold_this_mapping():
    model = _model()
    named = list(ModuleSource(model, stays=True).named_tensors())
    mapping = ResidentMapping()
    entries, sent = mapping.entries(named, {0: None, 1: None}, {0: 1, 1: 2})
    first = mapping.id
    decoded = _decoded(entries)
    assert sent == [0, 1] and [len(decoded[0]), len(decoded[1])] == [1, 2]  # one serialization per rank
    assert all(d["mapping"] == first and [n for n, _ in d["tensors"]] == [n for n, _ in named] for d in decoded[1])
    mapping.adopt(named)

    entries, sent = mapping.entries(named, {0: first, 1: "another sender's"}, {0: 1, 1: 2})
    decoded = _decoded(entries)
    assert sent == [1] and mapping.id == first
    assert decoded[0] == [{"mapping": first, "tensors": None}]  # the id alone
    assert all(d["tensors"] is not None for d in decoded[1])
    mapping.adopt(named)

    model[0].weight.data = model[0].weight.data.clone()  # a tensor moved: every engine maps again, a new id
    moved = list(ModuleSource(model, stays=True).named_tensors())
    _, sent = mapping.entries(moved, {0: first, 1: first}, {0: 1, 1: 2})
    assert sent == [0, 1] and mapping.id != first
    mapping.forget()  # a failed push: the next one maps everywhere
    _, sent = mapping.entries(moved, {0: mapping.id, 1: mapping.id}, {0: 1, 1: 2})
    assert sent == [0, 1]


def test_the_source_is_walked_again_only_when_its_parameters_moved():
    model = _model()
    mapping = ResidentMapping()
    source = ModuleSource(model, stays=True)
    named, stray = mapping.tensors_of(source, source.named_tensors())
    assert stray == [] and len(named) == 4

    def never():
        raise AssertionError("walked although nothing moved")
        yield

    again, stray = mapping.tensors_of(ModuleSource(model, stays=True), never())
    assert again is named and stray == []
    with torch.no_grad():
        model[1].bias.add_(1)  # new values in place: the same views
    assert mapping.tensors_of(ModuleSource(model, stays=True), never())[0] is named
    model[1].bias.data = model[1].bias.data.clone()  # a new storage: walked again
    fresh, stray = mapping.tensors_of(ModuleSource(model, stays=True), ModuleSource(model).named_tensors())
    assert fresh is not named and stray == []
    assert fresh[-1][1].data_ptr() == model[1].bias.data_ptr()
    other = _model()  # another model with its own parameters
    copies = ((name, t.clone()) for name, t in ModuleSource(other).named_tensors())
    named, stray = mapping.tensors_of(ModuleSource(other, stays=True), copies)
    assert stray == [name for name, _ in named]  # copies are not the parameters: packed, never kept
    again, _ = mapping.tensors_of(ModuleSource(other, stays=True), ModuleSource(other).named_tensors())
    assert stray and again is not named
