"""lora: only the LoRA adapter moves; engines keep the base weights they started with.

Each version is a new named adapter, `<adapter_name>-v<version>` (`served_name`): per sync, on every
engine, load the new version (unloading first only a copy of the same name, left by a sync of that
version that failed part-way), set the weight version, then unload the run's earlier versions (so at
most two are loaded for a moment: `--max-loaded-loras` bounds them, its LRU eviction never unloads
the new one). An engine that missed a sync does not hold the new name, so a generate request naming
it is refused there (400): a stale or missing adapter is never served, as the base model or as an
old version. source=tensors: one /load_lora_adapter_from_tensors call whose payload (one flattened
bucket in SGLang's byte form: the trainer's own parameter storages never become shared memory) is
serialized once per engine rank; source=directory: /load_lora_adapter of a peft directory. Either
way the adapter of each version is left as a peft directory under `<path>/version-<v>` (the newest
KEEP_LAST stay; with tensors it is written after the engines loaded, off their path): a restarted
engine (base weights from the model path) gets the current adapter from it (`saved_adapter`).

Fingerprints cover the adapter's tensors by peft key, as sent (no cast: engines keep adapters in
the dtype they arrive in); verification asks the engines for the adapter's fingerprints by name.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollfleet.weights.adapter import AdapterSource, SavedAdapter, save_adapter
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

    @classmethod
    def saved_adapter(cls, spec, version: str) -> str | None:
        """The adapter directory a sync of `version` left, while it is kept."""
        directory = version_dir(spec.path, version)
        return str(directory.resolve()) if (directory / SavedAdapter.WEIGHTS_FILE).is_file() else None

    def send(self, source: AdapterSource, version: str) -> SyncReport:
        if not isinstance(source, AdapterSource):
            raise TypeError(
                f"weight_sync.transport='lora' sends a LoRA adapter: give a LoraSource (a peft model) or a "
                f"SavedAdapter, got {type(source).__name__}; full weights go over tensor, nccl or disk"
            )
        name = served_name(self.spec.adapter_name, version)
        report = SyncReport(
            version=version, transport=self.name, engine_ids=[t.engine_id for t in self.targets], lora_name=name
        )
        with timed(report):
            tensors = list(source.named_tensors())
            config = source.config_dict()
            prints = fingerprints(tensors)
            report.fingerprints = {t.engine_id: dict(prints) for t in self.targets}
            report.tensors = len(tensors)
            report.bytes = sum(t.numel() * t.element_size() for _, t in tensors)
            self._unload_where_loaded(lambda loaded: loaded == name)  # a half-done sync of this very version
            if source.directory is not None:  # a saved adapter (a restore): the engines read it
                self._load_directory(name, source.directory)
            elif self.spec.source == "directory":
                self._load_directory(name, save_adapter(tensors, config, version_dir(self.spec.path, version)))
            else:
                self._load_tensors(name, tensors, config)
            self._each("update_weight_version", lambda t: ((version,), {})).result()
            self._unload_where_loaded(lambda loaded: loaded != name and is_version_of(loaded, self.spec.adapter_name))
        if source.directory is None and self.spec.source == "tensors":  # what a restarted engine restores from
            save_adapter(tensors, config, version_dir(self.spec.path, version))
        if source.directory is None:
            prune_versions(Path(self.spec.path), KEEP_LAST)
        return report

    def _load_directory(self, name: str, directory) -> None:
        self._each("load_lora_adapter", lambda t: ((name, str(Path(directory).resolve())), {})).result()

    def _load_tensors(self, name: str, tensors, config: dict) -> None:
        """One flattened bucket (copies, see the docstring: the trainer's own parameter storages never
        become shared memory), one dict per entry as SGLang's tp worker indexes it (`data["flattened_tensor"]`)."""
        device = tensors[0][1].device if tensors else torch.device("cpu")
        payload = pack_call(tensors, torch.empty(call_bytes(tensors), dtype=torch.uint8, device=device)).to_payload()
        self._each(
            "load_lora_adapter_from_tensors",
            lambda t: (
                (name, config, [serialize(payload) for _ in range(t.num_ranks)]),
                {"load_format": "flattened_bucket"},
            ),
        ).result()

    def _unload_where_loaded(self, unload) -> None:
        """Unload, on each engine, the adapters it lists (/v1/models, as SGLang lists them) for which
        `unload(name)` is true."""
        adapters = self._each("loaded_lora_adapters", lambda t: ((), {})).result()
        for target, names in zip(self.targets, adapters):
            for name in [n for n in names if unload(n)]:
                self._each("unload_lora_adapter", lambda t, n=name: ((n,), {}), engine_ids=[target.engine_id]).result()


def served_name(adapter_name: str, version: str) -> str:
    """The name the engines serve version `version` of the run's adapter under (lora_path of generate)."""
    return f"{adapter_name}-v{version}"


def is_version_of(name: str, adapter_name: str) -> bool:
    return name.startswith(f"{adapter_name}-v")
