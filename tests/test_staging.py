"""The sender's staging (two reusable buffers, packing, draining) and batched fingerprints."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.weights.transports.staging import ALIGN, DoubleBuffer, InFlight, call_bytes, pack_buckets, pack_bytes
from rollfleet.wire.fingerprint import Fingerprints, _device_hashes, fingerprints, sample_hashes, sample_view
from rollfleet.wire.naming import plain_names


def _call(shapes_and_dtypes):
    torch.manual_seed(0)
    return [(f"t{i}", (torch.randn(shape) * 10).to(dtype)) for i, (shape, dtype) in enumerate(shapes_and_dtypes)]


def test_pack_buckets_round_trips_mixed_dtypes_in_aligned_slices_of_one_buffer():
    call = _call([((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2), torch.float32), ((9,), torch.float16)])
    buffer = DoubleBuffer(1 << 20).take(0, call_bytes(call), torch.device("cpu"))
    buckets = pack_buckets(call, buffer)
    assert [b.dtype for b in buckets] == [torch.float32, torch.bfloat16, torch.float16]  # one per dtype, in order
    for bucket in buckets:
        assert bucket.flattened_tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert (bucket.flattened_tensor.data_ptr() - buffer.data_ptr()) % ALIGN == 0
    unpacked = {name: tensor for bucket in buckets for name, tensor in bucket.unpack().items()}
    assert set(unpacked) == {name for name, _ in call}
    for name, tensor in call:
        assert torch.equal(unpacked[name], tensor)


def test_pack_bytes_is_every_tensor_back_to_back():
    call = _call([((4,), torch.float32), ((3,), torch.bfloat16)])
    flat = pack_bytes(call, torch.empty(call_bytes(call), dtype=torch.uint8))
    expected = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in call])
    assert torch.equal(flat, expected)


def test_double_buffer_reuses_two_buffers_and_gives_oversized_calls_their_own():
    buffers = DoubleBuffer(bucket_bytes=1000)
    first, second = buffers.take(0, 100, torch.device("cpu")), buffers.take(1, 100, torch.device("cpu"))
    assert first.data_ptr() != second.data_ptr()
    assert buffers.take(2, 100, "cpu").data_ptr() == first.data_ptr()  # slot 2 is slot 0 again
    grown = buffers.take(2, 800, "cpu")  # on the CPU a buffer is sized to the call and grows when needed
    assert grown.numel() >= 800 and buffers.take(4, 500, "cpu").data_ptr() == grown.data_ptr()
    oversized = buffers.take(1, 5000, "cpu")
    assert oversized.numel() == 5000 and buffers.take(3, 10, "cpu").data_ptr() == second.data_ptr()


def _done(value=None, error=None) -> Future:
    future = Future()
    future.set_exception(error) if error else future.set_result(value)
    return future


def test_in_flight_keeps_two_calls_and_drains_everything_even_after_an_error():
    order = []

    class Work:  # a torch Work: waited, not asked for a result
        def __init__(self, name):
            self.name = name

        def wait(self):
            order.append(self.name)

    in_flight = InFlight()
    in_flight.add(_done(), Work("a"))
    in_flight.add(_done(error=ValueError("call 2 refused")), Work("b"))
    in_flight.make_room()  # two in flight: the oldest is finished to make room
    assert order == ["a"]
    in_flight.add(_done(), Work("c"))
    with pytest.raises(ValueError, match="call 2 refused"):
        in_flight.drain()
    assert order == ["a", "b", "c"] and not in_flight.calls  # call 2's work waited despite its error; 3 too


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 20000), samples=st.integers(1, 5000), offset=st.integers(0, 7), layout=st.integers(0, 2))
def test_sample_view_is_strided_and_covers_the_tensor(numel, samples, offset, layout):
    """Every numel // samples-th element in memory order of the tensor as its shape reads it: of a
    1-D tensor, of a 2-D view that starts `offset` elements into its storage, and of a transposed
    (non-contiguous) one, which alone is copied."""
    storage = torch.arange(numel + offset, dtype=torch.float32)
    tensor = storage[offset:]
    if layout == 1 and numel % 2 == 0 and numel:
        tensor = tensor.view(2, -1)
    elif layout == 2 and numel % 2 == 0 and numel:
        tensor = tensor.view(-1, 2).t()
    view = sample_view(tensor, samples)
    assert view.numel() == min(numel, samples)
    step = max(numel // samples, 1)
    assert torch.equal(view, tensor.reshape(-1)[::step][:samples])
    if numel > samples and tensor.is_contiguous():
        assert view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()  # a view, no copy


def one(tensor, dtype=None, samples=4096) -> str:
    """A fingerprint as the module documents it, computed here on its own in Python integers: the
    sampled elements (every numel // samples-th), cast to the dtype then float32; each one's 32 bits
    and its place mixed by splitmix64's finalizer, summed mod 2**64: 16 hex digits, then 8 of the shape's FNV-1a."""
    flat = tensor.reshape(-1)
    if flat.numel() > samples:
        flat = flat[:: flat.numel() // samples][:samples]
    values = (flat.to(dtype) if dtype is not None else flat).to(torch.float32).contiguous().numpy()
    mask, total = (1 << 64) - 1, 0
    for place, bits in enumerate(values.view(np.uint32).tolist()):
        x = (bits | place << 32) * 0x9E3779B97F4A7C15 & mask
        x = (x ^ x >> 30) * 0xBF58476D1CE4E5B9 & mask
        x = (x ^ x >> 27) * 0x94D049BB133111EB & mask
        total = (total + (x ^ x >> 31)) & mask
    code = 0xCBF29CE484222325  # FNV-1a over the number of dimensions and each size
    for size in (tensor.dim(), *tensor.shape):
        code = ((code ^ size) * 0x100000001B3) & mask
    return f"{total:016x}{code & 0xFFFFFFFF:08x}"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=6), st.integers(0, 2**31))
def test_the_device_hash_equals_the_host_hash(counts, seed):
    """The GPU's torch kernels (run here on the CPU) and the CPU's numpy ones give the same sums."""
    values = torch.randn(sum(counts), generator=torch.Generator().manual_seed(seed))
    values[::7] = torch.tensor([0.0, -0.0, float("nan"), float("inf")]).repeat(len(values[::7]))[: len(values[::7])]
    assert torch.equal(_device_hashes(values, counts), sample_hashes(values, counts))


def test_batched_fingerprints_equal_single_ones_and_see_any_sampled_change():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(300, 70), "b": torch.randn(10), "c": torch.randn(5000).to(torch.bfloat16)}
    collector = Fingerprints(torch.bfloat16, samples=128, hold_bytes=1)  # gather early: every add
    for name, tensor in tensors.items():
        collector.add(name, tensor)
    batched = collector.digests()
    assert batched == {name: one(tensor, torch.bfloat16, samples=128) for name, tensor in tensors.items()}
    assert batched == fingerprints(tensors.items(), torch.bfloat16, samples=128)
    changed = tensors["a"].clone()
    changed.view(-1)[0] += 1.0  # position 0 is always sampled
    assert one(changed, torch.bfloat16, samples=128) != batched["a"]
    assert one(tensors["a"].reshape(70, 300), torch.bfloat16, samples=128) != batched["a"]  # shape counts


def test_fingerprint_of_a_bucket_slice_equals_the_original_tensor():
    call = _call([((64, 33), torch.float32), ((17,), torch.float32)])
    (bucket,) = pack_buckets(call, torch.empty(call_bytes(call), dtype=torch.uint8))
    unpacked = bucket.unpack()
    assert fingerprints(unpacked.items(), torch.bfloat16) == fingerprints(call, torch.bfloat16)


def test_plain_names_leave_out_fused_experts_only():
    from transformers import AutoModelForCausalLM

    from rollfleet.tiny_models import make_tokenizer, tiny_config

    moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=len(make_tokenizer())))
    plain = plain_names(moe)
    names = [n for n, _ in moe.named_parameters(remove_duplicate=False)]
    assert sorted(set(names) - set(plain)) == sorted(n for n in names if ".mlp.experts." in n)
    assert all(plain[n] == n for n in plain)  # Qwen3's checkpoint names are its in-memory names
    assert plain_names(moe) is plain  # computed once per model


def test_pack_call_is_one_byte_form_bucket_at_aligned_offsets_that_unpacks_bit_exact():
    from rollfleet.weights.transports.staging import pack_call

    call = _call([((3, 5), torch.float32), ((7,), torch.bfloat16), ((9,), torch.float16), ((3,), torch.float64)])
    bucket = pack_call(call, torch.empty(call_bytes(call), dtype=torch.uint8))
    assert bucket.flattened_tensor.dtype == torch.uint8
    assert all(m.start_idx % ALIGN == 0 and m.numel == m.end_idx - m.start_idx for m in bucket.metadata)
    unpacked = bucket.unpack()
    for name, tensor in call:
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor)


def test_aligned_order_puts_every_tensor_at_a_multiple_of_its_element_size_when_packed_back_to_back():
    from rollfleet.weights.transports.staging import aligned_order

    call = aligned_order(
        _call([((7,), torch.bfloat16), ((3,), torch.float32), ((5,), torch.uint8), ((1,), torch.float64)])
    )
    offset = 0
    for _, tensor in call:
        assert offset % tensor.element_size() == 0
        offset += tensor.numel() * tensor.element_size()


def _layout_call(seed: int):
    """One call layout (mixed dtypes; tensors below, at and above the sample count; a non-contiguous
    one; an empty one) with values from `seed`."""
    torch.manual_seed(seed)
    return [
        ("big", torch.randn(300, 70)),
        ("half", (torch.randn(5000) * 3).to(torch.bfloat16)),
        ("small", torch.randn(10).to(torch.float16)),
        ("exact", torch.randn(128)),
        ("transposed", torch.randn(40, 9).t()),
        ("empty", torch.empty(0, 4)),
        ("ints", torch.arange(7, dtype=torch.int64)),
    ]


@pytest.mark.parametrize("engine_dtype", [None, torch.bfloat16, torch.float16])
def test_fingerprints_sampled_from_the_packed_bucket_equal_those_of_the_tensors(engine_dtype):
    from rollfleet.weights.transports.staging import PackPlan

    call = _layout_call(0)
    plan = PackPlan(call)
    bucket = plan.pack(call, torch.empty(call_bytes(call), dtype=torch.uint8))
    fused = Fingerprints(engine_dtype, samples=128)
    plan.fingerprint(bucket, fused)
    assert fused.digests() == fingerprints(call, engine_dtype, samples=128)
    assert fused.digests() == {}  # a collector starts empty after digests()


@pytest.mark.parametrize("keep_views", [False, True])
def test_a_reused_plan_and_buffer_carry_only_the_latest_call(keep_views):
    """The same layout packed again into the same buffer: every byte, every metadata record and every
    fingerprint is the new call's (the buffer is filled with a pattern first, so a slice the pack
    skipped would show); with `keep_views` too, and into another buffer between (its own slices)."""
    from rollfleet.weights.transports.staging import PackPlans

    plans, buffer = PackPlans(), torch.empty(call_bytes(_layout_call(0)) + 256, dtype=torch.uint8)
    another = torch.empty_like(buffer)
    for seed, into in ((1, buffer), (2, buffer), (3, another), (4, buffer)):
        call = _layout_call(seed)
        buffer.fill_(0xA5), another.fill_(0xA5)
        plan = plans.plan(call)
        bucket = plan.pack(call, into, keep_views=keep_views)
        assert bucket.flattened_tensor.data_ptr() == into.data_ptr()
        assert not (another if into is buffer else buffer).ne(0xA5).any()  # nothing written elsewhere
        unpacked = bucket.unpack()
        assert set(unpacked) == {name for name, _ in call}
        for name, tensor in call:
            assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor), name
        collector = Fingerprints(torch.bfloat16)
        plan.fingerprint(bucket, collector)
        assert collector.digests() == fingerprints(call, torch.bfloat16)
        wire = bucket.to_payload()["metadata"]
        assert [(r.name, tuple(r.shape), r.start_idx) for r in wire] == [
            (m.name, m.shape, m.start_idx) for m in bucket.metadata
        ]
    assert plans.plan(_layout_call(5)) is plan  # one plan per layout, kept across syncs
    plan.pack(_layout_call(6), another, keep_views=True)
    assert plan.kept_buffer == another.data_ptr()
    plan.pack(_layout_call(6), buffer)  # a pack without kept views lets the last kept buffer go
    assert plan.kept_buffer is None
    other = [("big", torch.randn(70, 300))]
    assert plans.plan(other) is not plan
    with pytest.raises(AssertionError, match="layout"):
        plan.pack(other, buffer)


@pytest.mark.parametrize("cast_to", [torch.bfloat16, torch.float16])
def test_a_plan_that_casts_as_it_packs_sends_what_packing_the_cast_tensors_sends(cast_to):
    """The tensor transport packs a trainer's fp32 tensors straight into its engines' dtype (no cast
    copy first): every byte, metadata record, size and fingerprint equals packing the cast tensors;
    integer tensors and tensors already in that dtype go as they are."""
    from rollfleet.weights.transports.staging import PackPlan, PackPlans

    call = _layout_call(4) + [("engine_dtype", torch.randn(5, 3).to(cast_to))]
    cast = [(name, t.to(cast_to) if t.is_floating_point() else t) for name, t in call]
    assert call_bytes(call, cast_to) == call_bytes(cast) < call_bytes(call)
    expected = PackPlan(cast).pack(cast, torch.full((call_bytes(cast),), 0xA5, dtype=torch.uint8))
    plan = PackPlans().plan(call, cast_to)
    bucket = plan.pack(call, torch.full((call_bytes(call, cast_to),), 0xA5, dtype=torch.uint8))  # padding alike
    assert torch.equal(bucket.flattened_tensor, expected.flattened_tensor)
    assert [m.to_wire() for m in bucket.metadata] == [m.to_wire() for m in expected.metadata]
    unpacked = bucket.unpack()
    for name, tensor in cast:
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor), name
    collector = Fingerprints(cast_to)
    plan.fingerprint(bucket, collector)  # the engine's fingerprints: of values in its dtype
    assert collector.digests() == fingerprints(call, cast_to) == fingerprints(cast, cast_to)
    # a plan is its wire layout: the cast tensors themselves pack the same; another layout is refused
    assert torch.equal(plan.pack(cast, bucket.flattened_tensor.clone()).flattened_tensor, bucket.flattened_tensor)
    with pytest.raises(AssertionError, match="layout"):
        plan.pack(call[1:], bucket.flattened_tensor)
    with pytest.raises(AssertionError, match="no cast"):  # kept views copy as they are
        plan.pack(call, bucket.flattened_tensor, keep_views=True)


def test_the_later_fingerprint_of_a_name_wins_over_what_was_gathered_before():
    """A sender gathers samples as tensors pass (`flush`); a name sent again with new values gets the
    later fingerprint, as hashing every tensor at the end gives; a collector starts empty after
    `digests()`."""
    early, late = _layout_call(5), _layout_call(6)
    collector = Fingerprints(torch.bfloat16, samples=64)
    for name, tensor in early:
        collector.add(name, tensor)
    collector.flush()
    assert collector.pending == len(early)
    for name, tensor in late[:3]:  # sent again with new values: these fingerprints win
        collector.add(name, tensor)
    got = collector.digests()
    assert got == fingerprints(late[:3] + early[3:], torch.bfloat16, samples=64)
    assert collector.pending == 0 and collector.digests() == {}


def _fingerprint_in_child(queue) -> None:
    queue.put(fingerprints(_layout_call(7), torch.bfloat16))


def test_a_forked_child_fingerprints_after_its_parent_did():
    """A child forked after its parent hashed (a multiprocessing worker) hashes too: on the CPU the
    hash runs single-threaded (torch's parallel CPU kernels in the parent hang a forked child's)."""
    import multiprocessing

    expected = fingerprints(_layout_call(7), torch.bfloat16)  # the parent's thread now exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_fingerprint_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) == expected
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
