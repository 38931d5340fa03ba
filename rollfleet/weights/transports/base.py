"""The one interface every transport implements, and what they share.

Ordering (enforced by the callers, stated here once): the trainer's push completes (send returns)
before the next optimizer step; every engine's load completes (its HTTP call returned) before
send returns; the fleet verifies fingerprints before it routes generate traffic at the new
version, so no sample starts on stale or partial weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rollfleet.weights.source import WeightSource, layer_key
from rollfleet.wire.client import EngineClient
from rollfleet.wire.fingerprint import Fingerprints


@dataclass(frozen=True)
class EngineTarget:
    """One engine a sync goes to."""

    engine_id: int
    url: str
    num_ranks: int  # tp_size * pp_size processes
    rank_offset: int  # first rank of this engine in a weight-update group (1 + engine_id * num_ranks)
    dtype: torch.dtype | None = None  # the engine's parameter dtype, for fingerprints
    api_key: str | None = None


@dataclass
class SyncReport:
    version: str
    transport: str
    engine_ids: list[int]
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # sender seconds per phase (pack, wait, ...)
    fingerprints: dict[int, dict[str, str]] = field(default_factory=dict)  # engine id -> name -> fingerprint

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class EngineCalls:
    """Concurrent HTTP calls to engines from synchronous sender code (a private event loop thread)."""

    def __init__(self, targets: list[EngineTarget], timeout_s: float):
        self.targets = {t.engine_id: t for t in targets}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollfleet-sync-http", daemon=True)
        self.thread.start()
        self.clients = self._run(self._make_clients(timeout_s)).result()

    async def _make_clients(self, timeout_s: float) -> dict[int, EngineClient]:
        return {i: EngineClient(t.url, api_key=t.api_key, timeout=timeout_s) for i, t in self.targets.items()}

    def _run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def each(self, verb: str, make_args, engine_ids: list[int] | None = None) -> Future:
        """Call `verb` on every target (or those of `engine_ids`) with `make_args(target) -> (args,
        kwargs)`; a future of all answers.

        The arguments are made here, in the caller's thread, before this returns: a `make_args`
        closing over a loop variable would otherwise read it after the caller's next iteration
        rebound it (engines got the next call's payload)."""
        arguments = {
            engine_id: make_args(target)
            for engine_id, target in self.targets.items()
            if engine_ids is None or engine_id in engine_ids
        }

        async def go():
            return await asyncio.gather(
                *(
                    getattr(self.clients[engine_id], verb)(*args, **kwargs)
                    for engine_id, (args, kwargs) in arguments.items()
                )
            )

        return self._run(go())

    def close(self) -> None:
        async def close_all():
            await asyncio.gather(*(c.close() for c in self.clients.values()))

        self._run(close_all()).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class Transport(ABC):
    name: ClassVar[str]

    def __init__(self, spec, targets: list[EngineTarget], *, timeout_s: float = 600.0):
        self.spec, self.targets = spec, targets
        self.calls = EngineCalls(targets, timeout_s)

    def connect(self) -> None:  # noqa: B027 (optional hook: most transports need no set-up)
        """Set up what the transport needs before its first send (a process group, a directory)."""

    @abstractmethod
    def send(self, source: WeightSource, version: str) -> SyncReport:
        """Deliver every tensor of `source` to every target; return after every engine loaded them."""

    def disconnect(self) -> None:
        self.calls.close()

    def _collectors(self) -> dict:
        """One fingerprint collector per target dtype, for `_recorded` and `_finish_fingerprints`."""
        return {dtype: Fingerprints(dtype) for dtype in {t.dtype for t in self.targets}}

    def _recorded(self, source: WeightSource, report: SyncReport, collectors: dict):
        """The source's tensors, counted and fingerprinted (per target dtype) as they pass; the
        fingerprints land in the report at `_finish_fingerprints`."""
        tensors = iter(source.named_tensors())
        while True:
            with timed(report, "source"):  # gathers and name conversion
                item = next(tensors, None)
            if item is None:
                break
            name, tensor = item
            report.tensors += 1
            report.bytes += tensor.numel() * tensor.element_size()
            with timed(report, "fingerprint"):
                for collector in collectors.values():
                    collector.add(name, tensor)
            yield name, tensor

    def _finish_fingerprints(self, report: SyncReport, collectors: dict) -> None:
        """Fill report.fingerprints from what `_recorded` collected. Call it after the last call went
        out: it waits for the sender's device (the host copies of the samples), which must not stall
        the pipeline."""
        with timed(report, "fingerprint_finish"):
            digests = {dtype: collector.digests() for dtype, collector in collectors.items()}
        for target in self.targets:
            report.fingerprints[target.engine_id] = digests[target.dtype]

    def _new_report(self, version: str) -> SyncReport:
        return SyncReport(version=version, transport=self.name, engine_ids=[t.engine_id for t in self.targets])


def iter_calls(named_tensors, limit_bytes: int):
    """Group tensors into update calls of about `limit_bytes`, never splitting a decoder layer: the
    engine fuses a layer's MoE experts in one call. A layer larger than the limit goes alone."""
    call, size, layer, layer_size, current = [], 0, [], 0, None
    for name, tensor in named_tensors:
        key = layer_key(name)
        if layer and key != current:
            if call and size + layer_size > limit_bytes:
                yield call
                call, size = [], 0
            call, size, layer, layer_size = call + layer, size + layer_size, [], 0
        current = key
        layer.append((name, tensor))
        layer_size += tensor.numel() * tensor.element_size()
    if call and size + layer_size > limit_bytes:
        yield call
        call = []
    if call + layer:
        yield call + layer


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    TRANSPORTS[cls.name] = cls
    return cls


def make_transport(spec, targets: list[EngineTarget], **kwargs: Any) -> Transport:
    try:
        cls = TRANSPORTS[spec.transport]
    except KeyError:
        raise ValueError(
            f"weight_sync.transport={spec.transport!r} has no sender here: use one of {sorted(TRANSPORTS)}"
        ) from None
    return cls(spec, targets, **kwargs)


@contextmanager
def timed(report: SyncReport, phase: str | None = None):
    """Add the elapsed time to report.seconds, or to report.phases[phase] when a phase is named."""
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        if phase is None:
            report.seconds += elapsed
        else:
            report.phases[phase] = report.phases.get(phase, 0.0) + elapsed
