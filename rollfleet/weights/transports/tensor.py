"""tensor (colocated): flattened buckets as CUDA IPC handles (GPU) or shared-memory handles (CPU)
through /update_weights_from_tensor. Each call carries whole decoder layers (one bucket per dtype
in it); every rank of an engine gets its own serialization of the same buckets (handles are
reference-counted per unpickling: one string read by two ranks would be released twice) and
slices its own shard. At most two calls' buckets are alive on the sender: one being loaded by the
engines, one being packed. The version is set after the last call landed."""

from __future__ import annotations

from rollfleet.weights.buckets import Bucket
from rollfleet.weights.serialize import serialize
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, iter_calls, register, timed


def buckets_by_dtype(call: list) -> list[Bucket]:
    by_dtype: dict = {}
    for name, tensor in call:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    return [Bucket.pack(members) for members in by_dtype.values()]


@register
class TensorTransport(Transport):
    name = "tensor"

    def send(self, source: WeightSource, version: str) -> SyncReport:
        report = self._new_report(version)
        in_flight = None  # (future, buckets): the buckets must stay alive until their engines answered
        with timed(report):
            for call in iter_calls(self._recorded(source, report), self.spec.bucket_mb << 20):
                buckets = buckets_by_dtype(call)
                payload = [b.to_payload() for b in buckets]
                future = self.calls.each("update_weights_from_tensor", lambda t: (
                    ([serialize(payload) for _ in range(t.num_ranks)],),
                    {"load_format": "flattened_bucket", "flush_cache": False}))
                if in_flight is not None:
                    in_flight[0].result()
                in_flight = (future, buckets)
                report.buckets += len(buckets)
            if in_flight is not None:
                in_flight[0].result()
            self.calls.each("update_weight_version", lambda t: ((version,), {})).result()
        return report
