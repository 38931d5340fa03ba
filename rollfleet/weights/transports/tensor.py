"""tensor (colocated): flattened buckets as CUDA IPC handles (GPU) or shared-memory handles (CPU)
through /update_weights_from_tensor. Each call carries whole decoder layers (one bucket per dtype
in it), packed into one of two reusable buffers: call k+1 is packed while the engines load call k,
so the sender's extra memory is two buckets. Every rank of an engine gets its own serialization of
the same buckets (handles are reference-counted per unpickling: one string read by two ranks would
be released twice) and slices its own shard. An engine finishes reading a call's buffer before it
answers; the version is set after the last call landed (engines with weight-update sessions: the
session opens before the first call and its end commits the update and the version)."""

from __future__ import annotations

import torch

from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, iter_calls, register, timed
from rollfleet.weights.transports.staging import DoubleBuffer, InFlight, call_bytes, pack_buckets, wait_all
from rollfleet.wire.serialize import serialize


@register
class TensorTransport(Transport):
    name = "tensor"

    def send(self, source: WeightSource, version: str) -> SyncReport:
        report, collectors = self._new_report(version), self._collectors()
        with timed(report):
            self._begin()
            try:
                self._send_calls(source, version, report, collectors)
            except BaseException:
                self._abandon()
                raise
            committing = self._commit(version)
            self._finish_fingerprints(report, collectors)
            with timed(report, "set_version"):
                error = wait_all(*committing)
        if error is not None:
            raise error
        return report

    def _send_calls(self, source: WeightSource, version: str, report: SyncReport, collectors: dict) -> None:
        buffers, in_flight = DoubleBuffer(self.spec.bucket_bytes), InFlight()
        try:
            for index, call in enumerate(
                iter_calls(self._recorded(source, report, collectors), self.spec.bucket_bytes)
            ):
                with timed(report, "wait_engines"):
                    in_flight.make_room()  # the engines finished reading the buffer packed two calls ago
                device = call[0][1].device
                with timed(report, "pack"):
                    buckets = pack_buckets(call, buffers.take(index, call_bytes(call), device))
                    if device.type == "cuda":
                        # An engine that still holds this buffer's IPC handle from an earlier call
                        # reads it without waiting on our stream: the packing must be finished first.
                        torch.cuda.current_stream(device).synchronize()
                with timed(report, "serialize"):
                    payload = [b.to_payload() for b in buckets]
                    entries = {t.engine_id: [serialize(payload) for _ in range(t.num_ranks)] for t in self.targets}
                # the buckets stay referenced until the engines answered: a call larger than a
                # bucket has a buffer of its own, which nothing else holds
                in_flight.add(
                    self._each(
                        "update_weights_from_tensor",
                        lambda t: (
                            (entries[t.engine_id],),
                            {
                                "load_format": "flattened_bucket",
                                "flush_cache": False,
                                **self._version_argument(t, version),
                            },
                        ),
                    ),
                    keep=buckets,
                )
                report.buckets += len(buckets)
        finally:
            with timed(report, "wait_engines"):
                in_flight.drain()
