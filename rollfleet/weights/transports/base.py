"""The one interface every transport implements, and what they share.

Ordering (enforced by the callers, stated here once): the trainer's push completes (send returns)
before the next optimizer step; every engine's load completes (its HTTP call returned) before
send returns; the fleet verifies fingerprints before it routes generate traffic at the new
version, so no sample starts on stale or partial weights.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rollfleet.weights.source import WeightSource, layer_key
from rollfleet.weights.transports.staging import wait_all, wire_dtype
from rollfleet.wire.client import uses_weight_update_sessions
from rollfleet.wire.fingerprint import Fingerprints
from rollfleet.wire.pool import EnginePool


@dataclass(frozen=True)
class EngineTarget:
    """One engine a sync goes to."""

    engine_id: int
    url: str
    num_ranks: int  # tp_size * pp_size processes
    rank_offset: int  # first rank of this engine in a weight-update group (1 + engine_id * num_ranks)
    dtype: torch.dtype | None = None  # the engine's parameter dtype, for fingerprints
    api_key: str | None = None
    admin_api_key: str | None = None  # the servers' --admin-api-key: weight routes take only it


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
    lora_name: str | None = None  # a LoRA sync: the adapter the fingerprints belong to (None: base weights)
    verified: list[int] = field(default_factory=list)  # engines the fleet verified against this report
    failed: dict[int, str] = field(default_factory=dict)  # engines a restore could not load, and why
    # the tensor transport's resident path (transports/resident.py): "kept" (an id sent), "mapped to
    # engines [...]" (the parameters sent), or why a push that could have gone that way was packed
    resident: str | None = None
    # which sender fed what (tensor transport): engine id -> the sender rank whose buffer each of its
    # ranks read, and per sender rank what it reported (pid, device, calls, bytes packed, ...)
    feeds: dict[int, list[int]] = field(default_factory=dict)
    senders: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


class Transport(ABC):
    """A way to move weights into engines. Besides connect/send/disconnect, a transport says what is
    specific to it, so callers ask it instead of branching on its name: the engines' server arguments,
    what a restarted engine loads, which checkpoint a restore may use, what the sender needs."""

    name: ClassVar[str]
    sends_full_weights: ClassVar[bool] = True  # False: only an adapter moves (a LoRA run: train.lora)
    restart_load_format: ClassVar[str] = "dummy"  # a restarted engine's load: its weights come by restore or push
    # True: every rank of a sharded sender may feed the engine ranks on its own device (a `feed=`
    # argument, transports/feed.py); False: rank 0 sends and the others only take part in the gathers
    feeds_from_every_rank: ClassVar[bool] = False

    @classmethod
    def server_args(cls, spec) -> list[str]:
        """Engine server flags this transport needs (same names on both backends)."""
        return []

    @classmethod
    def restore_checkpoint(cls, spec, version: str) -> str | None:
        """A directory this transport's own syncs left holding exactly `version`, or None."""
        return None

    @classmethod
    def saved_adapter(cls, spec, version: str, *, wait_s: float = 0.0, sleep=None) -> str | None:
        """A LoRA adapter directory this transport's own syncs left holding `version`, or None (waiting
        up to `wait_s` for one still being written)."""
        return None

    @classmethod
    def writing_adapter(cls, spec, version: str) -> bool:
        """Whether a sync of this transport is still writing the adapter directory of `version`."""
        return False

    @classmethod
    def sender_options(cls, model_path: str) -> dict[str, Any]:
        """Keyword arguments the sender needs from the run (beyond the spec and the targets)."""
        return {}

    def __init__(self, spec, targets: list[EngineTarget], *, timeout_s: float = 600.0, pool: EnginePool | None = None):
        """`pool`: the caller's engine pool (a fleet's), holding every target's url; without one the
        transport makes its own for the targets and closes it at disconnect."""
        self.spec, self.targets = spec, targets
        self._own_pool = pool is None
        api_key = next((t.api_key for t in targets if t.api_key), None)
        admin_api_key = next((t.admin_api_key for t in targets if t.admin_api_key), None)
        self.pool = pool or EnginePool.for_urls(
            {t.engine_id: t.url for t in targets}, api_key=api_key, admin_api_key=admin_api_key, timeout=timeout_s
        )
        self.session_engines: set[int] | None = None  # engines that take weight-update sessions (asked once)

    def connect(self) -> None:
        """Set up what the transport needs before its first send (a process group, a directory).
        Here: read every engine's protocol once, refusing an SGLang release the senders do not speak."""
        self._server_infos()

    @abstractmethod
    def send(self, source: WeightSource, version: str) -> SyncReport:
        """Deliver every tensor of `source` to every target; return after every engine loaded them."""

    def settle(self) -> None:
        """Wait for what the last send left running off its path (lora: the adapter directory it
        writes). The next send waits for it itself; a caller that times sends back to back, with no
        train step between them, calls this first to keep that wait apart (the sync benchmark).
        Transports that leave nothing running have nothing to wait for."""
        return None

    def disconnect(self) -> None:
        if self._own_pool:
            self.pool.close()

    def _each(self, verb: str, make_args, engine_ids=None) -> Future:
        """`verb` on every target (or those of `engine_ids`) with `make_args(target) -> (args, kwargs)`;
        a future of all answers.

        The arguments are made here, in the caller's thread, before this returns: a `make_args`
        closing over a loop variable would otherwise read it after the caller's next iteration
        rebound it (engines got the next call's payload)."""
        chosen = [t for t in self.targets if engine_ids is None or t.engine_id in engine_ids]
        return self.pool.each(verb, {t.engine_id: make_args(t) for t in chosen})

    def _server_infos(self) -> list[dict]:
        """Every target's /get_server_info (read once per engine client); notes which engines take
        weight-update sessions. Raises UnsupportedEngine for an SGLang release the senders do not speak."""
        infos = self._each("server_protocol", lambda t: ((), {})).result()
        self.session_engines = {
            t.engine_id for t, info in zip(self.targets, infos) if uses_weight_update_sessions(info)
        }
        return infos

    def _collectors(self) -> dict:
        """One fingerprint collector per target dtype, for `_recorded` and `_finish_fingerprints`."""
        return {dtype: Fingerprints(dtype) for dtype in {t.dtype for t in self.targets}}

    def _recorded(self, tensors, report: SyncReport, collectors: dict, cast_to: torch.dtype | None = None):
        """A source's `(name, tensor)` pairs, counted and fingerprinted (per target dtype) as they
        pass; the fingerprints land in the report at `_finish_fingerprints`. `cast_to`: floating
        tensors travel in this dtype, cast as they are packed (a fingerprint casts its samples to the
        target's dtype, so an uncast tensor has its cast's fingerprint)."""
        tensors = iter(tensors)
        while True:
            with timed(report, "source"):  # gathers and name conversion
                item = next(tensors, None)
            if item is None:
                break
            name, tensor = item
            report.tensors += 1
            report.bytes += tensor.numel() * wire_dtype(tensor, cast_to).itemsize
            with timed(report, "fingerprint"):
                for collector in collectors.values():
                    collector.add(name, tensor)
            yield name, tensor

    def _fingerprint_meanwhile(self, report: SyncReport, collectors: dict, source_done: bool) -> None:
        """Once the source is done (every tensor went out), read its last samples while the engines
        load a call (a collector gathers every HOLD_BYTES: what is read stays read when it was). The
        hashing is one reduction on the device at `_finish_fingerprints`."""
        if not source_done:
            return
        with timed(report, "fingerprint"):
            for collector in collectors.values():
                collector.flush()

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

    # ---- one update, all or nothing per engine (engines with sessions) ----------------------------
    def _begin(self) -> None:
        """Open a weight-update session on the engines that take them, before the first call."""
        begun = self._begin_meanwhile()
        try:
            if isinstance(begun, BaseException):
                raise begun
            begun.result()
        except BaseException:  # some engines may have opened theirs: a retry must find them closed
            self._abandon()
            raise

    def _begin_meanwhile(self) -> Future | BaseException:
        """`_begin` without waiting for the answers: their future, to wait for before the first call
        goes out (its round trip overlaps the first call's gathering and packing), or what failed
        before any was sent. After a failure the caller must `_abandon`."""
        try:
            if self.session_engines is None:
                self._server_infos()
            return self._each("begin_weight_update", lambda t: ((), {}), self.session_engines)
        except Exception as exc:  # noqa: BLE001  (reported where the first call would go)
            return exc

    def _version_argument(self, target: EngineTarget, version: str) -> dict[str, str]:
        """Inside a session a call carries the version (applied only when the session ends well)."""
        return {"weight_version": version} if target.engine_id in self.session_engines else {}

    def _commit(self, version: str) -> list[Future]:
        """After the last call: end the sessions (the engine commits only a complete update) and set
        the version on engines without sessions. Futures of both."""
        others = [t.engine_id for t in self.targets if t.engine_id not in self.session_engines]
        return [
            self._each("end_weight_update", lambda t: ((), {}), self.session_engines),
            self._each("update_weight_version", lambda t: ((version,), {}), others),
        ]

    def _abandon(self) -> None:
        """After a failed call: end the open sessions (an incomplete one is refused, and the engine
        serves nothing until a complete update); their answers do not hide the error that ended the sync.
        Nothing when the engines' protocol was never read (none was asked to open one)."""
        if self.session_engines is not None:
            wait_all(self._each("end_weight_update", lambda t: ((), {}), self.session_engines))


def iter_calls(named_tensors, limit_bytes: int, cast_to: torch.dtype | None = None):
    """Group tensors into update calls of about `limit_bytes`, never splitting a decoder layer: the
    engine fuses a layer's MoE experts in one call. A layer larger than the limit goes alone.
    `cast_to`: floating tensors count in this dtype (a sender that casts as it packs)."""
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
        layer_size += tensor.numel() * wire_dtype(tensor, cast_to).itemsize
    if call and size + layer_size > limit_bytes:
        yield call
        call = []
    if call + layer:
        yield call + layer


TRANSPORTS: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    TRANSPORTS[cls.name] = cls
    return cls


def transport_class(spec) -> type[Transport]:
    """The transport a `weight_sync` spec names."""
    try:
        return TRANSPORTS[spec.transport]
    except KeyError:
        raise ValueError(
            f"weight_sync.transport={spec.transport!r} has no sender here: use one of {sorted(TRANSPORTS)}"
        ) from None


def make_transport(spec, targets: list[EngineTarget], **kwargs: Any) -> Transport:
    return transport_class(spec)(spec, targets, **kwargs)


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
