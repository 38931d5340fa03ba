"""An engine's BucketViews: a layout seen before in the same buffer is unpacked without reading its
records again, and gives exactly what the slow way gives; anything unusual is read the slow way, so
its refusals stay what they were. Payloads cross as a sender sends them (shared memory, safe_loads)."""

from __future__ import annotations

import types

import pytest
import torch

from rollfleet.engine.tp.payloads import BucketViews, PayloadError, decode_entry, named_tensors
from rollfleet.weights.transports.staging import PackPlan
from rollfleet.wire.serialize import serialize, use_file_system_sharing

NAMES = [f"model.layers.{i}.{part}.weight" for i in range(2) for part in ("mlp.up_proj", "input_layernorm")]


def _call(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn((8, 4) if "proj" in name else (4,), generator=generator)) for name in NAMES]


class Sender:
    """A sender's reusable shared-memory buffer for one layout, packed again for every call."""

    def __init__(self):
        use_file_system_sharing()
        self.plan = PackPlan(_call(0), torch.bfloat16)
        self.buffer = torch.empty(self.plan.nbytes, dtype=torch.uint8).share_memory_()

    def payload(self, seed: int, views: BucketViews | None, held: list) -> tuple[dict, dict]:
        """(what the engine unpacked, what was sent); `held`: the engine's held payloads."""
        call = _call(seed)
        wire = serialize(self.plan.pack(call, self.buffer).to_payload())
        held.append(decode_entry([wire], 0))
        return named_tensors(held[-1], "flattened_bucket", 0, views), {n: t.bfloat16() for n, t in call}


def test_the_same_layout_in_the_same_buffer_is_unpacked_once_and_reads_the_new_values():
    sender, views, held = Sender(), BucketViews(), []
    first, sent = sender.payload(1, views, held)
    assert {n: torch.equal(first[n], sent[n]) for n in NAMES} == dict.fromkeys(NAMES, True)
    second, sent = sender.payload(2, views, held)  # the engine still holds the first: the same storage
    assert len(views) == 1
    assert {n: second[n].data_ptr() for n in NAMES} == {n: first[n].data_ptr() for n in NAMES}
    assert all(torch.equal(second[n], sent[n]) for n in NAMES)  # what call 2 wrote, not call 1
    slow = named_tensors(held[-1], "flattened_bucket", 0)
    assert {n: (t.shape, t.dtype, t.stride()) for n, t in second.items()} == {
        n: (t.shape, t.dtype, t.stride()) for n, t in slow.items()
    }
    second.pop(NAMES[0])  # a caller's changes to the dict it got stay its own
    assert NAMES[0] in named_tensors(held[-1], "flattened_bucket", 0, views)


def test_at_most_two_buffers_are_kept_and_clear_drops_them():
    views, held = BucketViews(), []
    senders = [Sender() for _ in range(3)]
    for seed, sender in enumerate(senders):
        got, sent = sender.payload(seed, views, held)
        assert all(torch.equal(got[n], sent[n]) for n in NAMES)
    assert len(views) == views.limit == 2
    views.clear()
    assert len(views) == 0
    one = BucketViews(limit=1)  # a LoRA engine's: the one buffer it holds
    for seed, sender in enumerate(senders[:2]):
        sender.payload(seed, one, held)
    assert len(one) == 1


def _with_records(payload: dict, change) -> dict:
    """The payload with each record rebuilt as `change(fields)` returns it (a dict or namespace)."""
    records = [change(dict(vars(r))) for r in payload["metadata"]]
    return {"flattened_tensor": payload["flattened_tensor"], "metadata": records}


@pytest.mark.parametrize(
    "change",
    [
        lambda f: f,  # a dict record (SGLang's form read by key)
        lambda f: types.SimpleNamespace(**{**f, "shape": tuple(f["shape"])}),
        lambda f: types.SimpleNamespace(**{**f, "dtype": "bfloat16"}),
    ],
    ids=["dict-records", "tuple-shapes", "dtype-names"],
)
def test_records_in_other_accepted_forms_are_read_the_slow_way_with_the_same_result(change):
    sender, views, held = Sender(), BucketViews(), []
    sender.payload(1, views, held)
    other = _with_records(held[-1], change)
    got = named_tensors(other, "flattened_bucket", 0, views)
    slow = named_tensors(other, "flattened_bucket", 0)
    assert len(views) == 0  # nothing kept for it, nor for the buffers before it
    assert all(torch.equal(got[n], slow[n]) for n in NAMES)


@pytest.mark.parametrize(
    "change",
    [
        lambda f: types.SimpleNamespace(**{**f, "end_idx": float(f["end_idx"])}),  # equal in value to a kept key
        lambda f: types.SimpleNamespace(**{**f, "end_idx": f["end_idx"] + 10**9}),
        lambda f: types.SimpleNamespace(**{**f, "shape": torch.Size([3, 3])}),
    ],
    ids=["float-index", "past-the-buffer", "wrong-shape"],
)
def test_a_bad_record_is_refused_as_without_views_even_after_its_good_twin_was_kept(change):
    sender, views, held = Sender(), BucketViews(), []
    sender.payload(1, views, held)
    bad = _with_records(held[-1], change)
    with pytest.raises(PayloadError) as without:
        named_tensors(bad, "flattened_bucket", 0)
    with pytest.raises(PayloadError) as with_views:
        named_tensors(bad, "flattened_bucket", 0, views)
    assert str(with_views.value) == str(without.value)
    got, sent = sender.payload(2, views, held)  # and the good layout is read right after it
    assert all(torch.equal(got[n], sent[n]) for n in NAMES)
