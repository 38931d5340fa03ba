"""lora: only the LoRA adapter moves; engines keep the base weights they started with.

Per sync, on every engine: unload the adapter name where it is loaded (SGLang refuses to load a
name twice), load the new adapter under that name, then set the weight version. source=tensors:
one /load_lora_adapter_from_tensors call whose payload (one flattened bucket in SGLang's byte form: the trainer's own
parameter storages never become shared memory) is serialized once per engine rank;
source=directory: the adapter is written as a peft directory under `<path>/version-<v>` (the
newest KEEP_LAST stay) and loaded with /load_lora_adapter. Between the unload and the load the
name is not served: the fleet syncs between generate phases, so nothing asks for it then.

Fingerprints cover the adapter's tensors by peft key, as sent (no cast: engines keep adapters in
the dtype they arrive in); verification asks the engines for the adapter's fingerprints by name.
"""

from __future__ import annotations

import torch

from rollfleet.weights.adapter import LoraSource, save_adapter
from rollfleet.weights.checkpoint import prune_versions
from rollfleet.weights.transports.base import SyncReport, Transport, register, timed
from rollfleet.weights.transports.disk import version_dir
from rollfleet.weights.transports.staging import call_bytes, pack_call
from rollfleet.wire.fingerprint import fingerprints
from rollfleet.wire.serialize import serialize

KEEP_LAST = 2


@register
class LoraTransport(Transport):
    name = "lora"
    sends_full_weights = False
    restart_load_format = "auto"  # a LoRA run never sends base weights: restarted engines load them from the model

    @classmethod
    def server_args(cls, spec) -> list[str]:
        """Engines serve the adapters this transport sends: --enable-lora and the adapter limits."""
        args = ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank)]
        if spec.lora_target_modules:
            args += ["--lora-target-modules", *spec.lora_target_modules]
        return args

    def send(self, source: LoraSource, version: str) -> SyncReport:
        if not isinstance(source, LoraSource):
            raise TypeError(
                f"weight_sync.transport='lora' sends a LoRA adapter: give a LoraSource (a peft model), "
                f"got {type(source).__name__}; full weights go over tensor, nccl or disk"
            )
        name = self.spec.adapter_name
        report = SyncReport(
            version=version, transport=self.name, engine_ids=[t.engine_id for t in self.targets], lora_name=name
        )
        directory = None
        with timed(report):
            tensors = list(source.named_tensors())
            config = source.config_dict()
            prints = fingerprints(tensors)
            report.fingerprints = {t.engine_id: dict(prints) for t in self.targets}
            report.tensors = len(tensors)
            report.bytes = sum(t.numel() * t.element_size() for _, t in tensors)
            self._unload_where_loaded(name)
            if self.spec.source == "tensors":
                device = tensors[0][1].device if tensors else torch.device("cpu")
                # copies, see the docstring: the trainer's own parameter storages never become shared memory
                # one bucket dict per entry, as SGLang's tp worker indexes it (`data["flattened_tensor"]`)
                payload = pack_call(
                    tensors, torch.empty(call_bytes(tensors), dtype=torch.uint8, device=device)
                ).to_payload()
                report.buckets = 1
                self._each(
                    "load_lora_adapter_from_tensors",
                    lambda t: (
                        (name, config, [serialize(payload) for _ in range(t.num_ranks)]),
                        {"load_format": "flattened_bucket"},
                    ),
                ).result()
            else:
                directory = save_adapter(tensors, config, version_dir(self.spec.path, version))
                self._each("load_lora_adapter", lambda t: ((name, str(directory.resolve())), {})).result()
            self._each("update_weight_version", lambda t: ((version,), {})).result()
        if directory is not None:
            prune_versions(directory.parent, KEEP_LAST)
        return report

    def _unload_where_loaded(self, name: str) -> None:
        adapters = self._each("loaded_lora_adapters", lambda t: ((), {})).result()  # /v1/models, as SGLang lists them
        loaded = [t.engine_id for t, names in zip(self.targets, adapters) if name in names]
        self._each("unload_lora_adapter", lambda t: ((name,), {}), engine_ids=loaded).result()
