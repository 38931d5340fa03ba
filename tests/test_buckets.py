"""Flattened buckets (SGLang's "flattened_bucket" format) and the allowlisted tensor pickles."""

from __future__ import annotations

import base64
import dataclasses
import io
import math
import os
import pickle
import subprocess
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.wire.buckets import (
    Bucket,
    FlattenedTensorMetadata,
    dtype_from_name,
    dtype_name,
    iter_buckets,
)
from rollfleet.wire.serialize import (
    LocalSerializedTensor,
    safe_loads,
    serialize,
    shared_cpu_buffer,
    use_file_system_sharing,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 200, shape, generator=generator).to(dtype)


named_tensor_lists = st.lists(
    st.tuples(st.lists(st.integers(0, 6), min_size=0, max_size=3), st.sampled_from(DTYPES)),
    min_size=1,
    max_size=12,
).map(lambda specs: [(f"w{i}", random_tensor(tuple(shape), dtype, i)) for i, (shape, dtype) in enumerate(specs)])


@settings(max_examples=150, deadline=None)
@given(named=named_tensor_lists, bucket_bytes=st.integers(1, 400))
def test_buckets_round_trip_exactly_one_dtype_each_within_the_limit(named, bucket_bytes):
    buckets = list(iter_buckets(iter(named), bucket_bytes))
    seen: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        assert bucket.flattened_tensor.dim() == 1
        assert {m.dtype for m in bucket.metadata} == {bucket.dtype}
        if len(bucket.metadata) > 1:
            assert bucket.nbytes <= bucket_bytes
        else:  # alone: it fits, or it is the one tensor larger than the limit
            assert bucket.nbytes <= bucket_bytes or bucket.metadata[0].numel * bucket.dtype.itemsize > bucket_bytes
        for meta in bucket.metadata:
            assert meta.end_idx - meta.start_idx == meta.numel == math.prod(meta.shape)
        seen.update(bucket.unpack())
    assert list(sorted(seen)) == sorted(name for name, _ in named)
    for name, tensor in named:
        assert seen[name].dtype == tensor.dtype and seen[name].shape == tensor.shape
        assert torch.equal(seen[name], tensor)
    position = {name: i for i, (name, _) in enumerate(named)}
    for bucket in buckets:  # input order inside each bucket
        assert [position[n] for n in bucket.names] == sorted(position[n] for n in bucket.names)


def test_oversize_tensor_gets_its_own_bucket_and_others_keep_filling():
    small = [(f"s{i}", torch.ones(4)) for i in range(3)]  # 16 bytes each
    named = [small[0], ("big", torch.ones(100)), small[1], small[2]]
    buckets = list(iter_buckets(named, bucket_bytes=32))
    assert [b.names for b in buckets] == [["big"], ["s0", "s1"], ["s2"]]


def test_unpack_gives_views_into_the_flat_tensor():
    bucket = Bucket.pack([("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(2))])
    out = bucket.unpack()
    assert out["a"].shape == (2, 3) and out["a"].data_ptr() == bucket.flattened_tensor.data_ptr()
    bucket.flattened_tensor[0] = 42
    assert out["a"][0, 0] == 42


@settings(max_examples=100, deadline=None)
@given(named=named_tensor_lists, shift=st.integers(0, 9), padded=st.booleans())
def test_a_byte_bucket_unpacks_to_views_of_its_bytes_wherever_it_starts(named, shift, padded):
    """uint8 buckets (SGLang's byte form) unpack to each tensor's values as views of the bucket's own
    bytes (one strided view of the bytes as the dtype where they are aligned for it; a slice, a
    reinterpretation and a reshape where they are not, a copy where a tensor's start is unaligned),
    whatever the flat tensor's own offset in its storage (`shift`); zero-size tensors included."""
    records, offset, parts = [], 0, []
    for name, tensor in named:
        size = tensor.element_size()
        gap = (-offset) % size if padded else 0  # unpadded: a tensor may start unaligned for its dtype
        parts.append(torch.zeros(gap, dtype=torch.uint8))
        offset += gap
        nbytes = tensor.numel() * size
        shape = tuple(tensor.shape)
        records.append(FlattenedTensorMetadata(name, shape, tensor.dtype, offset, offset + nbytes, nbytes))
        parts.append(tensor.reshape(-1).view(torch.uint8))
        offset += nbytes
    storage = torch.cat([torch.full((shift,), 7, dtype=torch.uint8), *parts, torch.zeros(3, dtype=torch.uint8)])
    flat = storage[shift : shift + offset]
    out = Bucket(flat, records).unpack()
    for (name, tensor), meta in zip(named, records):
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape and torch.equal(out[name], tensor)
        aligned = (shift + meta.start_idx) % tensor.element_size() == 0
        if aligned and tensor.numel():
            assert out[name].data_ptr() == flat.data_ptr() + meta.start_idx  # a view, not a copy


def test_a_bucket_holds_one_dtype():
    with pytest.raises(ValueError, match="one dtype"):
        Bucket.pack([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.bfloat16))])


def test_uint8_buckets_of_newer_sglang_are_read_by_bytes():
    """Newer SGLang packs mixed dtypes as bytes: start/end/numel count bytes of a uint8 tensor."""
    a, b = torch.randn(3).to(torch.bfloat16), torch.randn(2, 2)
    flat = torch.cat([a.view(torch.uint8), b.reshape(-1).view(torch.uint8)])
    records = [
        types.SimpleNamespace(name="a", shape=torch.Size([3]), dtype=torch.bfloat16, start_idx=0, end_idx=6, numel=6),
        {"name": "b", "shape": [2, 2], "dtype": "float32", "start_idx": 6, "end_idx": 22, "numel": 16},
    ]
    out = Bucket.from_payload({"flattened_tensor": flat, "metadata": records}).unpack()
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)  # b starts at byte 6: copied to align


def test_inconsistent_metadata_is_refused_with_the_tensor_name():
    bucket = Bucket.pack([("a", torch.ones(4)), ("b", torch.ones(2))])
    bad = Bucket(
        bucket.flattened_tensor, [bucket.metadata[0], FlattenedTensorMetadata("b", (3,), torch.float32, 4, 7, 3)]
    )
    with pytest.raises(ValueError, match="b: start_idx=4, end_idx=7"):
        bad.unpack()
    with pytest.raises(ValueError, match="has no 'numel'"):
        Bucket.from_payload(
            {
                "flattened_tensor": torch.ones(1),
                "metadata": [{"name": "a", "shape": [1], "dtype": "float32", "start_idx": 0, "end_idx": 1}],
            }
        )


def test_dtype_names():
    assert dtype_from_name("bfloat16") is torch.bfloat16 and dtype_name(torch.float32) == "float32"
    assert dtype_from_name(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'torch.bfloat16' is not known"):
        dtype_from_name("torch.bfloat16")  # SGLang does getattr(torch, name): the bare name only


# ---- serialize ---------------------------------------------------------------------------------
READ_IN_OTHER_PROCESS = """
import sys
from rollfleet.wire.buckets import Bucket
from rollfleet.wire.serialize import safe_loads
payload = safe_loads(sys.stdin.read())
tensors = Bucket.from_payload(payload).unpack()
tensors["w"][0, 0] = -1.0  # shared memory: the sender sees this write
print(sorted(tensors), float(tensors["w"].sum()))
"""


def test_a_bucket_payload_crosses_to_an_unrelated_process_through_shared_memory():
    w = torch.arange(12.0).reshape(3, 4)
    bucket = Bucket.pack([("w", w), ("v", torch.ones(5))])
    out = subprocess.run(
        [sys.executable, "-c", READ_IN_OTHER_PROCESS],
        input=serialize(bucket.to_payload()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected_sum = float(w.sum()) - 1.0  # w[0, 0] was 0.0
    assert out.stdout.split() == ["['v',", "'w']", str(expected_sum)]
    assert bucket.flattened_tensor[0] == -1.0


def test_a_shared_cpu_buffer_stays_where_it_is_when_serialized():
    """A buffer not yet shared moves at its first serialization (another address, the old memory freed
    under any thread reading it); one from `shared_cpu_buffer` does not move, and another process
    reads what was written into it."""
    plain = torch.arange(64, dtype=torch.uint8)
    before = plain.data_ptr()
    serialize(plain)
    assert plain.data_ptr() != before  # what the directory writer of a LoRA push read from, freed
    buffer = shared_cpu_buffer(1 << 12)
    buffer.view(torch.float32).copy_(torch.arange(1024.0))
    before = buffer.data_ptr()
    record = FlattenedTensorMetadata("w", (32, 32), torch.float32, 0, 4096, 4096)  # uint8: indexed in bytes
    payload = serialize(Bucket(buffer, [record]).to_payload())
    assert buffer.data_ptr() == before
    out = subprocess.run(
        [sys.executable, "-c", READ_IN_OTHER_PROCESS], input=payload, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['w']", str(float(torch.arange(1024.0).sum()) - 1.0)]  # w[0, 0] was 0.0
    assert buffer.view(torch.float32)[0] == -1.0  # the other process wrote into this very memory


class RunsAShellCommand:
    def __reduce__(self):
        return (os.system, ("touch /tmp/rollfleet-should-not-exist",))


def test_safe_loads_refuses_globals_outside_the_allowlist():
    with pytest.raises(pickle.UnpicklingError, match=r"refused global '(posix|os)\.system'"):
        safe_loads(pickle.dumps(RunsAShellCommand()))
    with pytest.raises(pickle.UnpicklingError, match="refused global 'builtins.eval'"):
        safe_loads(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(ValueError, match="not valid base64"):
        safe_loads("not base64 !!")
    assert not os.path.exists("/tmp/rollfleet-should-not-exist")


def test_safe_loads_refuses_setting_attributes_on_allowed_classes():
    # GLOBAL torch.storage.TypedStorage, then BUILD with slot state {'pwned': 1}: setattr on the class
    with pytest.raises(pickle.UnpicklingError, match="refused to set state"):
        safe_loads(b"ctorch.storage\nTypedStorage\n(N(dS'pwned'\nI1\nstb.")
    assert not hasattr(torch.TypedStorage, "pwned")


class GivenState:
    """Pickles as `rebuild(*args)` followed by BUILD with `state` (a 3-tuple __reduce__)."""

    def __init__(self, rebuild, args, state):
        self.rebuild, self.args, self.state = rebuild, args, state

    def __reduce__(self):
        return self.rebuild, self.args, self.state


def _shared_tensor_reduce(numel: int = 4):
    from torch.multiprocessing import reductions

    use_file_system_sharing()  # as the reader: its allowlist names only the file-system rebuild
    return reductions.reduce_tensor(torch.zeros(numel).share_memory_())


@pytest.mark.parametrize(
    "stream, needle",
    [
        # Tensor.__setstate__ of a legacy 4-tuple is `set_(storage, offset, size, stride)`, which grows
        # the tensor past its storage: BUILD must never reach a rebuilt tensor
        (lambda: raw_pickle(GivenState(*_shared_tensor_reduce(), (None, 0, (1 << 20,), (1,)))), "refused to set state"),
        (lambda: raw_pickle(GivenState(*_shared_tensor_reduce(), {"requires_grad": True})), "refused to set state"),
        # ... nor a rebuilt storage, nor a named function
        (lambda: b"\x80\x04ctorch.multiprocessing.reductions\nrebuild_tensor\n}S'x'\nI1\nsb.", "refused to set state"),
        # calling a rebuilt tensor, a class by INST (protocol 0), a class made by NEWOBJ
        (lambda: raw_pickle([GivenState(*_shared_tensor_reduce(), None)])[:-2] + b"K\x01\x85R.", "calling"),
        (lambda: b"(I256\nitorch\nUntypedStorage\n.", "calling"),
        (lambda: b"\x80\x04ctorch\nTensor\nM\x00\x01\x85\x81.", "NEWOBJ class argument"),
        (lambda: b"\x80\x04ctorch\nSize\n)\x81.", "NEWOBJ class argument"),
        (lambda: b"\x80\x02\x82\x01.", "unregistered extension code"),  # EXT1: copyreg's registry is empty
        (lambda: b"\x80\x04P0\n.", "persistent"),  # PERSID: no persistent_load
    ],
    ids=[
        "tensor-set_",
        "tensor-attributes",
        "function-state",
        "call-tensor",
        "inst-storage",
        "newobj-tensor",
        "newobj-size",
        "ext",
        "persid",
    ],
)
def test_what_the_c_unpickler_reaches_is_inert(stream, needle):
    """pickle's C unpickler checks only `find_class`: every other object an opcode can reach while a
    payload is read must refuse being called, given state or made (rollfleet/wire/unpickled.py)."""
    with pytest.raises(Exception, match=needle) as refused:
        safe_loads(stream())
    assert isinstance(refused.value, (pickle.UnpicklingError, ValueError)), refused.value


def test_allowed_classes_take_no_state_and_keep_their_attributes():
    module = "sglang.srt.model_executor.model_runner"
    for cls, stream in [
        (types.SimpleNamespace, b"ctypes\nSimpleNamespace\n(N}S'pwned'\nI1\nstb."),
        (LocalSerializedTensor, b"c" + module.encode() + b"\nLocalSerializedTensor\n(N}S'pwned'\nI1\nstb."),
        (LocalSerializedTensor, b"c" + module.encode() + b"\nLocalSerializedTensor\n}S'values'\n]sb."),
    ]:
        with pytest.raises((pickle.UnpicklingError, TypeError)):
            safe_loads(stream)
        assert not hasattr(cls, "pwned") and LocalSerializedTensor.values == ()
    with pytest.raises(pickle.UnpicklingError, match="calling LocalSerializedTensor"):  # REDUCE on the record class
        safe_loads(b"\x80\x04c" + module.encode() + b"\nLocalSerializedTensor\n)R.")


def test_rebuilt_tensors_are_in_place_wherever_the_payload_put_them():
    t, u = torch.arange(4.0), torch.ones(2)
    shared = ("s", t)
    payload = {"k": [t, (u, [t]), shared, shared], ("key", 1): {"inner": types.SimpleNamespace(x=u, y=(t,))}}
    out = safe_loads(serialize(payload))
    k = out["k"]
    assert torch.equal(k[0], t) and torch.equal(k[1][0], u) and torch.equal(k[1][1][0], t)
    assert k[2] is k[3] and torch.equal(k[2][1], t)  # a shared tuple stays one object
    record = out[("key", 1)]["inner"]
    assert torch.equal(record.x, u) and torch.equal(record.y[0], t)
    assert torch.equal(safe_loads(serialize(t)), t) and safe_loads(serialize({t.shape: 1})) == {t.shape: 1}
    tensor_key = safe_loads(serialize({u: "value", frozenset({("a", u)}): 2}))
    assert [type(key) for key in tensor_key] == [torch.Tensor, frozenset]
    ((name, tensor),) = list(tensor_key)[1]
    assert name == "a" and torch.equal(tensor, u)


def test_sglang_pickled_metadata_records_are_read(monkeypatch):
    """A sender using SGLang's own FlattenedTensorMetadata dataclass pickles that class by name."""
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:  # the fields of SGLang's dataclass, under its module name
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name in ["sglang", "sglang.srt", "sglang.srt.weight_sync", module.__name__]:
        monkeypatch.setitem(sys.modules, name, module if name == module.__name__ else types.ModuleType(name))
    t = torch.randn(2, 3)
    record = FlattenedTensorMetadata(name="t", shape=t.shape, dtype=t.dtype, start_idx=0, end_idx=6, numel=6)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"flattened_tensor": t.reshape(-1), "metadata": [record]})
    monkeypatch.delitem(sys.modules, module.__name__)  # the engine has no SGLang installed
    out = Bucket.from_payload(safe_loads(buffer.getvalue())).unpack()
    assert torch.equal(out["t"], t)


# ---- SGLang's own payload forms: verl's LocalSerializedTensor, the patched CUDA rebuild --------------
def sglang_module(monkeypatch, dotted: str) -> types.ModuleType:
    """A module under SGLang's name in this process only, so objects pickle by SGLang's names (the
    engine has no SGLang; sglang 0.5.23 itself needs CUDA torch and cannot be installed here)."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[dotted]


def sglang_local_serialized_tensor(monkeypatch, module: str):
    """A dataclass shaped as SGLang's LocalSerializedTensor (`values: List[bytes]`), under `module`."""

    @dataclasses.dataclass
    class LocalSerializedTensor:
        values: list

    LocalSerializedTensor.__module__ = module
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    sglang_module(monkeypatch, module).LocalSerializedTensor = LocalSerializedTensor
    return LocalSerializedTensor


def raw_pickle(obj) -> bytes:
    """MultiprocessingSerializer.serialize(obj): ForkingPickler bytes, not base64."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "module",
    ["sglang.srt.model_executor.model_runner_components.weight_updater", "sglang.srt.model_executor.model_runner"],
)
def test_verl_local_serialized_tensors_give_each_rank_its_own_tensor(monkeypatch, module):
    from rollfleet.engine.tp.payloads import PayloadError, named_tensors

    wrapper = sglang_local_serialized_tensor(monkeypatch, module)
    per_rank = [torch.randn(3, 2), torch.randn(3, 2)]
    # verl (sglang.srt.weight_sync.utils.update_weights): each rank's tensor serialized on its own, the
    # list of (name, LocalSerializedTensor) serialized again once per tp rank
    pairs = [
        ("w", wrapper(values=[raw_pickle(t) for t in per_rank])),
        ("b", wrapper(values=[raw_pickle(t) for t in per_rank])),
    ]
    entries = [base64.b64encode(raw_pickle(pairs)).decode() for _ in range(2)]
    monkeypatch.delitem(sys.modules, module)  # the engine reads it without SGLang
    for rank in (0, 1):
        tensors = named_tensors(safe_loads(entries[rank]), None, rank)
        assert sorted(tensors) == ["b", "w"] and torch.equal(tensors["w"], per_rank[rank])
    with pytest.raises(PayloadError, match="w: .*holds 2 values, tp rank 2 has none"):
        named_tensors(safe_loads(entries[0]), "direct", 2)


def test_local_serialized_tensor_refusals(monkeypatch):
    from rollfleet.engine.tp.payloads import PayloadError, named_tensors

    module = "sglang.srt.model_executor.model_runner_components.weight_updater"
    wrapper = sglang_local_serialized_tensor(monkeypatch, module)
    not_a_tensor = safe_loads(raw_pickle([("w", wrapper(values=[raw_pickle({"x": 1})]))]))
    with pytest.raises(PayloadError, match=r"w: UnpicklingError: .*values\[0\] holds a dict, not a tensor"):
        named_tensors(not_a_tensor, None, 0)
    evil_inside = safe_loads(raw_pickle([("w", wrapper(values=[pickle.dumps(RunsAShellCommand())]))]))
    with pytest.raises(PayloadError, match=r"refused global '(posix|os)\.system'"):
        named_tensors(evil_inside, None, 0)
    for values in ([1, 2], "abc", None):
        with pytest.raises(pickle.UnpicklingError, match="state must be"):
            safe_loads(raw_pickle(wrapper(values=values)))
    with pytest.raises(pickle.UnpicklingError, match="only metadata records may be made"):  # NEWOBJ with arguments
        safe_loads(b"\x80\x04c" + module.encode() + b"\nLocalSerializedTensor\nK\x01\x85\x81.")
    assert not os.path.exists("/tmp/rollfleet-should-not-exist")


def test_cuda_devices_by_index_or_uuid():
    from rollfleet.wire.serialize import cuda_device_index, with_device_uuid

    uuids = ["GPU-aaaa", "GPU-bbbb"]
    assert cuda_device_index(1, uuids) == 1 and cuda_device_index("GPU-bbbb", uuids) == 1
    assert cuda_device_index("GPU-aaaa", uuids) == 0
    with pytest.raises(
        pickle.UnpicklingError, match=r"GPU GPU-cccc is not visible to this process \(its GPUs: \['GPU-aaaa'"
    ):
        cuda_device_index("GPU-cccc", uuids)
    with pytest.raises(pickle.UnpicklingError, match="device index 2, this process has 2 CUDA devices"):
        cuda_device_index(2, uuids)
    for bad in (True, 1.0, None, b"GPU-aaaa"):
        with pytest.raises(pickle.UnpicklingError, match="neither a device index nor a GPU UUID"):
            cuda_device_index(bad, uuids)
    args = (torch.Tensor, (2,), (1,), 0, torch.UntypedStorage, torch.float32, 1, b"h", 8, 0, False, b"r", 0, b"e", True)
    assert with_device_uuid(args, uuids) == (*args[:6], "GPU-bbbb", *args[7:])
    assert with_device_uuid(with_device_uuid(args, uuids), ["GPU-other"]) == with_device_uuid(args, uuids)


class CudaTensorAsPickled:
    """Pickles as torch's reduction of a CUDA tensor with SGLang's patch on: the rebuild function
    named `rebuild`, the device at argument 6 as a UUID (sglang/srt/utils/patch_torch.py). SGLang's
    patch cannot pickle a CPU tensor (torch's CPU reduction has 3 arguments, the patch edits the 7th),
    so the stream is made here with made-up IPC handles: on a CPU machine it cannot be opened anyway."""

    def __init__(self, rebuild, device, storage_bytes: int = 24):
        self.rebuild, self.device, self.storage_bytes = rebuild, device, storage_bytes

    def __reduce__(self):
        size, stride = torch.Size([2, 3]), (3, 1)
        return self.rebuild, (
            torch.Tensor,
            size,
            stride,
            0,
            torch.UntypedStorage,
            torch.float32,
            self.device,
            b"ipc-handle",
            self.storage_bytes,
            0,
            False,
            b"ref-counter",
            0,
            b"event",
            True,
        )


def test_sglang_patched_cuda_rebuild_is_allowed_and_maps_the_uuid(monkeypatch):
    from torch.multiprocessing import reductions

    module = sglang_module(monkeypatch, "sglang.srt.utils.patch_torch")

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("never called: the reader resolves the name to its own rebuild")

    _rebuild_cuda_tensor_modified.__module__ = module.__name__
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    module._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
    patched = raw_pickle([("w", CudaTensorAsPickled(_rebuild_cuda_tensor_modified, "GPU-1234"))])
    assert b"sglang.srt.utils.patch_torch" in patched and b"_rebuild_cuda_tensor_modified" in patched
    torch_named = raw_pickle([("w", CudaTensorAsPickled(reductions.rebuild_cuda_tensor, "GPU-1234"))])
    monkeypatch.delitem(sys.modules, module.__name__)
    for payload in (patched, torch_named):  # both names: allowed, checked, and the UUID looked up here
        with pytest.raises(
            pickle.UnpicklingError, match=r"GPU GPU-1234 is not visible to this process \(its GPUs: \[\]\)"
        ):
            safe_loads(payload)
    too_small = raw_pickle([("w", CudaTensorAsPickled(reductions.rebuild_cuda_tensor, "GPU-1234", storage_bytes=8))])
    with pytest.raises(pickle.UnpicklingError, match="needs 24 bytes, its storage holds 8"):
        safe_loads(too_small)  # the extent check comes before any device is touched


def test_a_decoded_payload_goes_when_its_user_drops_it_without_a_collection():
    """An engine holds a push's payload until the sync ends; the sender's buffer (CUDA IPC on a GPU)
    can be freed only once every reference to it is gone. A reference cycle in the decoding kept it
    until Python's collector ran, which an engine makes rare: a colocated trainer could not give its
    buckets back before the engine's resume."""
    import gc
    import weakref

    from rollfleet.engine.tp.payloads import decode_entry, named_tensors

    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(16, 8) for i in range(3)}
    (bucket,) = iter_buckets(tensors.items(), 1 << 20)
    wire = serialize(bucket.to_payload())  # one bucket per entry, as the tensor transport sends it
    enabled = gc.isenabled()
    gc.disable()
    try:
        payload = decode_entry([wire], 0)
        named = named_tensors(payload, "flattened_bucket", 0)
        assert all(torch.equal(named[k], v) for k, v in tensors.items())
        flat = weakref.ref(payload["flattened_tensor"])
        del payload, named
        assert flat() is None, "the decoded payload outlived its last user (a reference cycle)"
    finally:
        if enabled:
            gc.enable()
