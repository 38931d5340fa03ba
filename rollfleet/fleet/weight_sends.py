"""Where a weight send goes and what the engines must report after it: the targets (the serving
engines that are up, with their weight-update group ranks), the send itself over a transport, and
the fingerprints a checkpoint implies. Nothing here verifies or changes an engine's state: the
fleet's push (rollfleet.fleet.fleet) verifies and moves states; the restore sources
(rollfleet.fleet.restore) send through the same calls and Recovery verifies what they loaded."""

from __future__ import annotations

from rollfleet.config import RunConfig
from rollfleet.fleet import standby
from rollfleet.fleet.lifecycle import EngineSlot
from rollfleet.layout import weight_update_group
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports import EngineTarget, SyncReport, make_transport
from rollfleet.weights.transports.base import transport_class
from rollfleet.wire.buckets import dtype_from_name
from rollfleet.wire.fingerprint import fingerprints
from rollfleet.wire.hf_files import read_checkpoint
from rollfleet.wire.pool import EnginePool


class WeightSends:
    def __init__(self, cfg: RunConfig, slots: list[EngineSlot], pool: EnginePool):
        self.cfg, self.rollout, self.slots, self.pool = cfg, cfg.rollout, slots, pool

    def running(self, engine_ids: list[int] | None = None) -> list[int]:
        """Serving engines that are up (standbys left out: they take no pushes, sleep or wake)."""
        slots = standby.in_rotation(self.slots)
        return [s.engine_id for s in slots if s.is_running and (engine_ids is None or s.engine_id in engine_ids)]

    def weight_targets(self, engine_ids: list[int] | None = None) -> list[EngineTarget]:
        """The live engines a sync goes to; group ranks are numbered over the targeted engines only
        (rollfleet.layout.weight_update_group), so a sync to a subset forms a smaller group."""
        slots = [self.slots[e] for e in self.running(engine_ids)]
        unknown = [s for s in slots if s.dtype is None]
        for slot, info in zip(unknown, self.pool.on_all("get_model_info", [s.engine_id for s in unknown])):
            slot.dtype = info.get("dtype", "")  # SGLang does not report one: fingerprints in the sent dtype
        ranks = self.rollout.layout.gpus_per_engine
        offsets, _ = weight_update_group([ranks] * len(slots))
        return [
            EngineTarget(
                engine_id=s.engine_id,
                url=s.url,
                num_ranks=ranks,
                rank_offset=offset,
                dtype=dtype_from_name(s.dtype) if s.dtype else None,
                **self.rollout.keys,
            )
            for s, offset in zip(slots, offsets)
        ]

    def send_weights(self, source: WeightSource, version: str, targets: list[EngineTarget], spec, **options):
        """Only the send of `source` over `spec` (options: the transport's, and `timeout_s`): no
        verification, no state change (`Fleet._push` does those for a push, `Recovery` for a restore)."""
        options = {**transport_class(spec).sender_options(self.rollout.model_path), **options}
        options.setdefault("timeout_s", self.rollout.request_timeout_s)
        sender = make_transport(spec, targets, pool=self.pool, **options)
        sender.connect()
        try:
            return sender.send(source, version)
        finally:
            sender.disconnect()

    def expected_from_checkpoint(self, path: str, weight_version: str, engine_ids: list[int] | None = None):
        """What engines holding checkpoint `path` at `weight_version` must report (fingerprints in
        each engine's dtype; none in version mode, which reads no files)."""
        targets = self.weight_targets(engine_ids)
        tensors = read_checkpoint(path) if self.cfg.verify_mode == "fingerprint" else {}
        report = SyncReport(version=weight_version, transport="disk", engine_ids=[t.engine_id for t in targets])
        if tensors:
            for target in targets:
                report.fingerprints[target.engine_id] = fingerprints(tensors.items(), target.dtype)
        return report
