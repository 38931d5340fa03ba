"""tensor (colocated): flattened buckets as CUDA IPC handles (GPU) or shared-memory handles (CPU)
through /update_weights_from_tensor. Each call carries whole decoder layers as ONE bucket in SGLang's
byte form (every dtype in one uint8 tensor; an entry is one `{"flattened_tensor", "metadata"}` dict),
packed into one of two reusable buffers: call k+1 is packed while the engines load call k,
so a sender's extra memory is two buckets. Every rank of an engine gets its own serialization of
the buckets (handles are reference-counted per unpickling: one string read by two ranks would be
released twice) and slices its own shard.

Who packs (transports/feed.py): one process for every engine rank (`SoloFeed`), or, colocated,
every trainer rank for the engine ranks on its own GPU (`RankFeed`): each rank gathers the full
tensors anyway (FSDP), packs them into its own device's buffer and sends its handles to rank 0,
which makes one HTTP call per engine with the entry of each engine rank from the rank on its GPU.

Ordering, stated once: rank 0 asks the engines that take sessions to open one and, without waiting,
every rank starts; rank 0 has the answers before call 0's exchange (a failure to open is its state
there). Every rank runs the same steps per call, in lockstep over the feed, with ONE exchange per call:
  1. every rank takes the next call's tensors from the source (the FSDP gathers) and packs them into
     buffer slot k % 2, serializing its handles;
  2. rank 0 waits until the engines answered call k-1; every rank waits for its pack's copy (on a
     GPU it ran meanwhile); then every rank gives every rank its state (a call, the end, or an
     error) with its handles, and all decide the same: go on, stop (done) or stop (failed); on "go"
     rank 0 posts call k with each engine rank's entry from its packer.
Why slot k % 2 is free at step 1: the exchange of call k-1 could not complete before rank 0 entered
it, and rank 0 enters it only after call k-2 (the slot's last user) was answered. So one call is in
flight while the next is gathered and packed, and the ranks need no second message per call.
One sender rank (the driver, a one-GPU trainer) needs no exchange to know a slot is free: it waits
for call k-2's answer before packing call k and posts call k while call k-1 is in flight, so an
engine that ends a call finds the next one queued instead of waiting a round trip for it.
After the last call rank 0 waits for every answer, then ends the sessions (commit) or, after any
failure on any rank, abandons them; then it tells every rank the outcome, and only then do the
ranks drop their buffers. Engines finish reading a call's buffer before they answer; the version
is set after the last call landed (engines with sessions: at the session's end).

Fixed costs per call: a call's layout is planned once per run (`staging.PackPlan`: offsets, the
wire metadata records, the buffer's split), so packing is one multi-tensor copy and serializing
pickles records made once. The fingerprints stay those of the source's tensors, read late (once
the source is done, or every HOLD_BYTES): they are what the trainer holds after the push, so a
trainer that changed a tensor under the push fails verification (tests/test_fleet_sync.py); read
from the packed buffers they would only say the engines hold what was sent. Rank 0 reads the last
ones while the engines load the last call (`_fingerprint_meanwhile`, before it waits for call k-1)
and hashes them all at the end, one reduction on its device (rollfleet.wire.fingerprint).

A one-rank trainer whose parameters stay in place (no offload) skips all of this after its first
push: the engines keep its parameters mapped and each push is one call with an id
(transports/resident.py)."""

from __future__ import annotations

import torch

from rollfleet.weights.source import ModuleSource, WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, iter_calls, register, timed
from rollfleet.weights.transports.feed import SoloFeed
from rollfleet.weights.transports.resident import ResidentMapping, resident_capable
from rollfleet.weights.transports.staging import DoubleBuffer, InFlight, PackPlans, call_bytes, wait_all
from rollfleet.wire.control_requests import RESIDENT_LOAD_FORMAT
from rollfleet.wire.handoffs import prompt_handoffs
from rollfleet.wire.serialize import serialize

GO, DONE, FAILED = "go", "done", "failed"


class WeightFeedError(RuntimeError):
    """A push stopped by a failure on another sender rank (rank 0 raises the failure itself)."""


@register
class TensorTransport(Transport):
    name = "tensor"
    feeds_from_every_rank = True

    def __init__(self, spec, targets, *, feed: SoloFeed | None = None, **kwargs):
        super().__init__(spec, targets, **kwargs)
        self.feed = feed or SoloFeed()
        self.plans = PackPlans()  # call layouts, the same every sync
        self.mapping = ResidentMapping()  # the resident path's (resident.py)
        self.resident_engines: set[int] | None = None  # engines that keep a mapping (read with the protocols)
        # the engine ranks this sender rank packs for: (engine id, rank in engine)
        self.mine = [
            (t.engine_id, i)
            for t in targets
            for i in range(t.num_ranks)
            if self.feed.feeder(t.engine_id, i) == self.feed.rank
        ]

    def send(self, source: WeightSource, version: str) -> SyncReport:
        """Every rank of the feed calls it together; each returns (rank 0's report has the totals)
        or each raises."""
        report, collectors = self._new_report(version), self._collectors()
        held: dict[int, list] = {}  # this rank's buffers the engines may still read, by call index
        with timed(report), prompt_handoffs():
            begun = self._begin_meanwhile() if self.feed.is_caller else None  # waited for before call 0
            try:
                tensors, cast_to = uncast_tensors(source)
                mapped, tensors = self._mappable(source, tensors, report)
                if mapped is not None:
                    failure = self._send_resident(mapped, cast_to, version, report, collectors, begun)
                else:
                    if self.feed.is_caller:
                        tensors = self._recorded(tensors, report, collectors, cast_to)
                    failure = self._send_calls(tensors, cast_to, version, report, collectors, held, begun)
                if self.feed.is_caller:
                    failure = self._end(failure, version, report, collectors)
                if mapped is not None:
                    self.mapping.forget() if failure else self.mapping.adopt(mapped)
            except BaseException:  # unexpected, here: the other ranks fail at the group's timeout
                if self.feed.is_caller:
                    self._abandon()
                self.mapping.forget()
                raise
            self._agree(failure)
        return report

    # ---- the resident path (transports/resident.py) ----------------------------------------------
    def _server_infos(self) -> list[dict]:
        infos = super()._server_infos()
        self.resident_engines = {t.engine_id for t, info in zip(self.targets, infos) if resident_capable(info)}
        return infos

    def _mappable(self, source, tensors, report: SyncReport) -> tuple[list | None, object]:
        """(the source's tensors as a list when this push goes the resident way, else None; the
        tensors to pack otherwise). Called after the sessions were asked to open (protocols read)."""
        engines = {t.engine_id for t in self.targets}
        if not (
            getattr(self.spec, "resident", False)
            and self.feed.world_size == 1
            and getattr(source, "stays", False)
            and self.resident_engines is not None
            and engines <= self.resident_engines & (self.session_engines or set())
        ):
            return None, tensors
        with timed(report, "source"):
            named, stray = self.mapping.tensors_of(source, tensors)
        if named and not stray:
            return named, None
        report.resident = f"packed: {len(stray)} tensors are not parameters ({', '.join(stray[:3])})"
        return None, iter(named)

    def _send_resident(self, named: list, cast_to, version: str, report: SyncReport, collectors: dict, begun):
        """The only rank: one call per engine with the mapping's id, and its tensors where the engine
        does not hold it (resident.py); the fingerprints are read while the engines copy (nothing
        changes the parameters before they answered). Returns the failure, if any."""
        with timed(report, "begin"):
            failure = begun if isinstance(begun, BaseException) else self._attempt(begun.result)
        if failure is not None:
            return failure
        chosen = [t.engine_id for t in self.targets if t.engine_id in self.session_engines]
        held = {e: answer.get("rollfleet_resident_mapping") for e, answer in zip(chosen, begun.result())}
        device = named[0][1].device
        with timed(report, "serialize"):
            entries, sent = self.mapping.entries(named, held, {t.engine_id: t.num_ranks for t in self.targets})
        if device.type == "cuda":  # the engines read the parameters on their own streams
            with timed(report, "wait_device"):
                torch.cuda.synchronize(device)
        options = {"load_format": RESIDENT_LOAD_FORMAT, "flush_cache": False}
        call = self._each(
            "update_weights_from_tensor",
            lambda t: ((entries[t.engine_id],), {**options, **self._version_argument(t, version)}),
        )

        def fingerprint():
            for _ in self._recorded(iter(named), report, collectors, cast_to):
                pass
            self._fingerprint_meanwhile(report, collectors, True)

        failure = self._attempt(fingerprint)
        with timed(report, "wait_engines"):
            failure = wait_all(call) or failure  # waited for first: the engines read our memory
        report.resident = f"mapped to engines {sent}" if sent else "kept"
        report.senders = {0: {**self._facts(device), "calls": 1, "bytes": report.bytes}}
        report.feeds = {t.engine_id: [0] * t.num_ranks for t in self.targets}
        return failure

    @staticmethod
    def _attempt(step) -> BaseException | None:
        try:
            step()
        except Exception as exc:  # noqa: BLE001  (every rank is told at the next agreement)
            return exc
        return None

    def _agree(self, failure: BaseException | None) -> None:
        """Rank 0 tells every rank whether the push failed; every rank raises if so."""
        message = self.feed.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if message is None:
            return
        if failure is not None:
            raise failure
        raise WeightFeedError(f"weight push stopped on rank {self.feed.rank}: rank 0 reports {message}")

    def _end(self, failure, version: str, report: SyncReport, collectors: dict) -> BaseException | None:
        """Rank 0, after every call was answered: commit (sessions, version), or abandon after a failure."""
        if failure is not None:
            self._abandon()
            return failure
        committing = self._commit(version)
        self._finish_fingerprints(report, collectors)
        with timed(report, "set_version"):
            return wait_all(*committing)

    def _send_calls(self, tensors, cast_to, version: str, report: SyncReport, collectors: dict, held: dict, begun):
        """The calls in lockstep (module docstring); returns the failure that stopped them, if any
        (rank 0: every call it posted was answered before this returns). `tensors`: the source's,
        recorded on rank 0, cast to `cast_to` as they are packed. `begun` (rank 0): the sessions'
        opening, answered before call 0 goes out."""
        caller = self.feed.is_caller
        calls = iter_calls(tensors, self.spec.bucket_bytes, cast_to)
        ahead = self.feed.world_size == 1  # one sender rank: it knows itself when a slot is free
        buffers, in_flight = DoubleBuffer(self.spec.bucket_bytes), InFlight(depth=2 if ahead else 1)
        failure: BaseException | None = None
        index = 0
        while True:
            call, state = _next_call(calls)
            if ahead and failure is None and call is not None:
                with timed(report, "wait_engines"):
                    failure = self._attempt(in_flight.make_room)  # call k-2 answered: slot k % 2 is free
            packed = ({}, [], None) if call is None else self._pack_mine(call, index, buffers, report, cast_to)
            contribution, keep, copying = packed
            if "error" in contribution:
                state = ("error", contribution["error"])
            if caller and failure is None and state[0] != "error":  # read while the engines load call k-1
                failure = self._attempt(lambda: self._fingerprint_meanwhile(report, collectors, call is None))
            if caller and failure is None and index == 0:
                with timed(report, "begin"):  # the sessions opened while call 0 was gathered and packed
                    failure = begun if isinstance(begun, BaseException) else self._attempt(begun.result)
            if caller and failure is None and not ahead:
                with timed(report, "wait_engines"):
                    failure = self._attempt(in_flight.make_room)  # call k-1 answered: slot (k+1) % 2 is free
            if copying is not None:  # every rank's copy done before the exchange, so before rank 0 posts
                with timed(report, "pack"):
                    copying.synchronize()
            with timed(report, "ranks"):
                everyone = self.feed.all_gather((_failed(failure) if caller and failure else state, contribution))
            decision, detail = _decide([rank_state for rank_state, _ in everyone])
            if decision != GO:
                break
            held.pop(index - 1, None)  # answered before this exchange
            held[index] = keep
            if caller:
                failure = self._post(index, [c for _, c in everyone], version, in_flight, keep, report)
            index += 1
        if caller:
            with timed(report, "wait_engines"):
                error = self._attempt(in_flight.drain)
            failure = failure or error or (RuntimeError(detail) if decision == FAILED else None)
        return failure

    def _pack_mine(self, call, index: int, buffers: DoubleBuffer, report: SyncReport, cast_to) -> tuple:
        """This rank's handles for the engine ranks it feeds, or its error; the buckets to keep alive;
        and on a GPU an event at the end of the pack's copy (None: nothing to wait for). An error
        becomes this rank's state at the call's exchange, so every rank stops there. `cast_to`:
        floating tensors are cast to it as they are packed.

        The copy is waited for at the exchange, not here: an engine reads the buffer through its IPC
        handle without waiting on our stream, so it must be finished before the call is posted, but
        meanwhile rank 0 serializes and waits for the engines' previous call."""
        if not self.mine:
            return {"entries": {}, "buckets": 0, "bytes": 0, "facts": self._facts(None)}, [], None
        try:
            device = call[0][1].device
            with timed(report, "pack"):
                buffer = buffers.take(index, call_bytes(call, cast_to), device)
                buckets = [self.plans.plan(call, cast_to).pack(call, buffer)]
                copying = None
                if device.type == "cuda":
                    copying = torch.cuda.Event()
                    copying.record(torch.cuda.current_stream(device))
            with timed(report, "serialize"):
                entries = {key: serialize(buckets[0].to_payload()) for key in self.mine}  # one dict per entry
        except Exception as exc:  # noqa: BLE001  (rank 0 stops every rank at the next step)
            return {"error": f"call {index}: {type(exc).__name__}: {exc}"}, [], None
        packed = sum(b.nbytes for b in buckets)
        facts = self._facts(device)
        return {"entries": entries, "buckets": len(buckets), "bytes": packed, "facts": facts}, buckets, copying

    def _facts(self, device) -> dict:
        return {**self.feed.facts, "device": str(device) if device is not None else None}

    def _post(self, index, gathered, version, in_flight: InFlight, keep, report) -> BaseException | None:
        """Rank 0: one /update_weights_from_tensor per engine, entry i from the rank that packed it."""
        packer = {key: rank for rank, c in enumerate(gathered) for key in c["entries"]}
        missing = [(t.engine_id, i) for t in self.targets for i in range(t.num_ranks) if (t.engine_id, i) not in packer]
        if missing:
            return RuntimeError(f"call {index}: no sender rank packed (engine id, engine rank) {missing}")
        report.feeds = {t.engine_id: [packer[t.engine_id, i] for i in range(t.num_ranks)] for t in self.targets}
        entries = {
            engine_id: [gathered[rank]["entries"][engine_id, i] for i, rank in enumerate(ranks)]
            for engine_id, ranks in report.feeds.items()
        }
        _note_senders(report, gathered)
        options = {"load_format": "flattened_bucket", "flush_cache": False}
        # the buckets stay referenced until the engines answered: a call larger than a bucket has
        # a buffer of its own, which nothing else holds
        in_flight.add(
            self._each(
                "update_weights_from_tensor",
                lambda t: ((entries[t.engine_id],), {**options, **self._version_argument(t, version)}),
            ),
            keep=keep,
        )
        report.buckets += max(c["buckets"] for c in gathered)
        return None


def uncast_tensors(source: WeightSource) -> tuple:
    """`(named tensors, dtype to cast them to as they are packed)`: a trainer's source
    (rollfleet.weights.source.ModuleSource) leaves the casts that need no collective to the pack
    (one copy of each tensor instead of two); any other source's tensors are sent as they come."""
    if isinstance(source, ModuleSource) and source.dtype is not None:
        return source.named_tensors(cast=False), source.dtype
    return source.named_tensors(), None


def _next_call(calls) -> tuple[list | None, tuple[str, str | None]]:
    """The next call's tensors and this rank's state: ("call", None), ("end", None) or ("error", why)."""
    try:
        call = next(calls, None)
    except Exception as exc:  # noqa: BLE001  (every rank stops at this step)
        return None, _failed(exc)
    return call, ("end", None) if call is None else ("call", None)


def _failed(exc: BaseException) -> tuple[str, str]:
    return "error", f"{type(exc).__name__}: {exc}"


def _decide(states: list[tuple[str, str | None]]) -> tuple[str, str | None]:
    """The same decision on every rank from every rank's state."""
    errors = [f"rank {rank}: {why}" for rank, (kind, why) in enumerate(states) if kind == "error"]
    if errors:
        return FAILED, "; ".join(errors)
    kinds = {kind for kind, _ in states}
    if kinds == {"end"}:
        return DONE, None
    if kinds == {"call"}:
        return GO, None
    ended = [rank for rank, (kind, _) in enumerate(states) if kind == "end"]
    return FAILED, f"sender ranks {ended} ran out of tensors before the others: their sources differ"


def _note_senders(report: SyncReport, gathered: list[dict]) -> None:
    """What each sender rank reported and packed, summed over the calls (report.senders)."""
    for rank, contribution in enumerate(gathered):
        sender = report.senders.setdefault(rank, {**contribution["facts"], "calls": 0, "bytes": 0})
        sender["calls"] += 1 if contribution["entries"] else 0
        sender["bytes"] += contribution["bytes"]
