"""Fingerprints that prove an engine holds exactly the tensors that were sent.

A fingerprint hashes a fixed sample of a tensor's elements, cast to the engine's dtype and then to
float32, plus the shape. The sample is every `step`-th element of the flattened tensor, `samples`
of them with `step = numel // samples` (all elements when there are fewer): a strided view, so
sampling launches no kernel per tensor. Casts between the dtypes used here are exact into float32,
so sender and engine agree bit for bit on the same weights, on any device.

The hash runs where the samples are (`sample_hashes`): each sample's 32 bits and its place in the
tensor's sample are mixed into 64 bits (a splitmix64 finalizer: integer multiplies and shifts,
which wrap the same way on every device) and summed per tensor (integer sums: the same in any
order), so one tensor's samples are reduced to one int64 on the device and only 8 bytes per tensor
cross to the host, where the sum and the shape give the 24 hex digits. Any one changed
sample changes its tensor's sum (the mix is a bijection; the sum of the others is fixed), and so
does a permutation of the samples (the position is mixed in). Until 432a53d the host hashed the
samples (5 MB a push of the benches' model) with sha256, on a thread of its own; the device does
it in one pass of elementwise kernels and a scan.

`Fingerprints` batches many tensors: pending samples are gathered with one `torch.cat` per dtype and
reduced at `digests()`, one reduction per device. Pending views keep their tensors alive, so the
collector gathers early once they reference more than `hold_bytes` (a sender's gathered full
tensors are temporaries).

A sender that fingerprints what it packed (the LoRA transport: an adapter as sent) samples its
packed buffer instead, with ONE index gather per dtype (`sample_positions` of each tensor, offset
to where it lies, computed once per layout: rollfleet.weights.transports.staging.PackPlan).
"""

from __future__ import annotations

import numpy as np
import torch

DEFAULT_SAMPLES = 4096
HOLD_BYTES = 256 << 20


def sample_view(tensor: torch.Tensor, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """The sampled elements of `tensor` as a 1-D view (a copy only for a non-contiguous tensor). A
    contiguous tensor's is one strided view of its storage (a reshape and a slice cost twice as much:
    a push samples every tensor, 267 of them 2.2 ms of a 4.16 GB push on an H100's host)."""
    numel = tensor.numel()
    if numel > samples and tensor.is_contiguous():
        return tensor.detach().as_strided((samples,), (numel // samples,))
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= samples:
        return flat
    step = flat.numel() // samples
    return flat[: step * samples : step]


def sample_positions(numel: int, samples: int = DEFAULT_SAMPLES) -> torch.Tensor:
    """Which elements of a flattened tensor of `numel` elements `sample_view` takes (int64, on the CPU)."""
    if numel <= samples:
        return torch.arange(numel)
    return torch.arange(samples) * (numel // samples)


_MASK = (1 << 64) - 1
# splitmix64's finalizer: its three odd multipliers and its shifts
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_SHIFTS = (30, 27, 31)


def sample_hashes(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """One int64 per tensor, on `values`' device: `values` holds each tensor's float32 samples back
    to back (`counts[i]` of tensor i); each sample's bits and its place in its tensor's sample are
    mixed into 64 bits and the mixes summed per tensor, mod 2**64 (wrapping integer arithmetic: the
    same on any device and in any order). On a GPU, torch's kernels without waiting for the device;
    on the CPU numpy's (one thread: torch's parallel CPU kernels would hang a child forked after
    them, as a multiprocessing worker is)."""
    if values.is_cuda:
        return _device_hashes(values.contiguous(), counts)
    return torch.from_numpy(_host_hashes(values.contiguous().numpy(), counts))


def _host_hashes(values: np.ndarray, counts: list[int]) -> np.ndarray:
    """In place where numpy allows: 13 ms for 1.1M samples (270 tensors) on this project's 2-core
    CPU, 18 with a new array per step. sha256 of the same bytes takes 2.6 ms there: on the CPU this
    hash costs more than the one it replaced, the price of one definition on every device."""
    sizes = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(sizes)
    mixed = np.arange(values.size, dtype=np.uint64)  # each sample's place in its tensor's sample
    mixed -= np.repeat((ends - sizes).astype(np.uint64), sizes)
    mixed <<= np.uint64(32)
    mixed |= values.view(np.uint32)
    shifted = np.empty_like(mixed)
    for multiplier, shift in zip(_MIX, _SHIFTS):
        np.multiply(mixed, np.uint64(multiplier), out=mixed)
        np.right_shift(mixed, np.uint64(shift), out=shifted)
        mixed ^= shifted
    running = np.zeros(values.size + 1, dtype=np.uint64)
    np.cumsum(mixed, out=running[1:])
    return (running[ends] - running[ends - sizes]).view(np.int64)


def _device_hashes(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`_host_hashes` in torch's int64 (it has no uint64 arithmetic): the multipliers as the signed
    values of their bits, the shifts masked to unsigned ones."""
    device, total = values.device, values.numel()
    sizes = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
    ends = sizes.cumsum(0)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes, output_size=total)
    place = torch.arange(total, device=device) - (ends - sizes)[owner]
    mixed = (values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (place << 32)
    for multiplier, shift in zip(_MIX, _SHIFTS):
        mixed = mixed * (multiplier - (1 << 64) if multiplier >= 1 << 63 else multiplier)
        mixed = mixed ^ _shifted(mixed, shift)
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), mixed.cumsum(0)])
    return running[ends] - running[ends - sizes]


def _shifted(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` shifted right as unsigned 64-bit (torch shifts int64 arithmetically: the sign bit would
    fill the top and `x ^ shifted` would lose it)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _digest(total: int, shape: tuple[int, ...]) -> str:
    """24 hex digits: a tensor's sample sum (`sample_hashes`, 16) and its shape (FNV-1a over the
    sizes, 8); string work only (322 tensors: 0.3 ms on this project's 2-core CPU)."""
    code = 0xCBF29CE484222325
    for size in (len(shape), *shape):
        code = ((code ^ size) * 0x100000001B3) & _MASK
    return f"{total & _MASK:016x}{code & 0xFFFFFFFF:08x}"


def _as_float32(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    return values.to(torch.float32)


class Fingerprints:
    """Collect fingerprints of many tensors; one host copy per device at `digests()`."""

    def __init__(
        self, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES, hold_bytes: float = HOLD_BYTES
    ):
        self.dtype, self.samples, self.hold_bytes = dtype, samples, hold_bytes
        self._views: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        self._held = 0
        self._gathered: list[tuple[list[tuple[str, tuple[int, ...], int]], torch.Tensor]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._views.append((name, tuple(tensor.shape), sample_view(tensor, self.samples)))
        self._held += tensor.numel() * tensor.element_size()
        if self._held > self.hold_bytes:
            self.flush()

    def add_sample(self, name: str, shape: tuple[int, ...], sample: torch.Tensor) -> None:
        """`sample`: `sample_view(tensor, self.samples)` of a tensor of `shape` that outlives the
        collector's next `flush()` (an engine's parameter)."""
        self._views.append((name, tuple(shape), sample))

    def add_gathered(self, records: list[tuple[str, tuple[int, ...], int]], values: torch.Tensor) -> None:
        """Samples gathered already: `values` holds each record's (name, shape, count) samples back to
        back, as `sample_view` takes them, in the tensors' own dtype."""
        self._gathered.append((list(records), _as_float32(values, self.dtype)))

    def flush(self) -> None:
        """Gather the pending views now, on their device (one `cat` per device and dtype): their
        tensors may change or go after this."""
        groups: dict[tuple[torch.device, torch.dtype], list] = {}
        for entry in self._views:
            groups.setdefault((entry[2].device, entry[2].dtype), []).append(entry)
        for entries in groups.values():
            values = _as_float32(torch.cat([view for _, _, view in entries]), self.dtype)
            self._gathered.append(([(name, shape, view.numel()) for name, shape, view in entries], values))
        self._views, self._held = [], 0

    @property
    def pending(self) -> int:
        """Tensors added since the last `digests()`."""
        return len(self._views) + sum(len(records) for records, _ in self._gathered)

    def digests(self) -> dict[str, str]:
        """Every fingerprint collected since the last call, hashed on each device in one reduction
        (`sample_hashes`; waits for it); the later of two for one name wins."""
        self.flush()
        by_device: dict[torch.device, list] = {}
        for records, values in self._gathered:
            by_device.setdefault(values.device, []).append((records, values))
        out: dict[str, str] = {}
        for batches in by_device.values():
            values = batches[0][1] if len(batches) == 1 else torch.cat([values for _, values in batches])
            records = [record for records, _ in batches for record in records]
            sums = sample_hashes(values, [count for _, _, count in records]).tolist()  # 8 bytes a tensor
            out.update((name, _digest(total, shape)) for (name, shape, _), total in zip(records, sums))
        self._gathered = []
        return out


def fingerprints(named_tensors, dtype: torch.dtype | None = None, samples: int = DEFAULT_SAMPLES) -> dict[str, str]:
    collector = Fingerprints(dtype, samples)
    for name, tensor in named_tensors:
        collector.add(name, tensor)
    return collector.digests()


def mismatches(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or are missing on the engine side."""
    return sorted(name for name, value in expected.items() if got.get(name) != value)
