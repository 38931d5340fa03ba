"""disk: the sender writes a HF directory per version; engines load it with /update_weights_from_disk.

Directories are `<path>/version-<v>`; the newest `keep_last` stay (recovery restores from them)."""

from __future__ import annotations

from pathlib import Path

from rollfleet.weights.checkpoint import prune_versions, save_checkpoint
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, register, timed
from rollfleet.wire.handoffs import prompt_handoffs

KEEP_LAST = 2


def version_dir(root: str | Path, version: str) -> Path:
    return Path(root) / f"version-{version}"


@register
class DiskTransport(Transport):
    name = "disk"

    @classmethod
    def restore_checkpoint(cls, spec, version: str) -> str | None:
        """The sync's own directory of `version`, while it is kept."""
        directory = version_dir(spec.path, version)
        return str(directory.resolve()) if directory.is_dir() else None

    @classmethod
    def sender_options(cls, model_path: str) -> dict:
        return {"config_dir": model_path}  # the directory engines load needs the model's config and tokenizer

    def __init__(self, spec, targets, *, config_dir: str | None = None, **kwargs):
        super().__init__(spec, targets, **kwargs)
        self.config_dir = config_dir

    def send(self, source: WeightSource, version: str) -> SyncReport:
        report, collectors = self._new_report(version), self._collectors()
        directory = version_dir(self.spec.path, version)
        with timed(report), prompt_handoffs():
            save_checkpoint(self._recorded(source.named_tensors(), report, collectors), directory, self.config_dir)
            self._finish_fingerprints(report, collectors)
            self._each(
                "update_weights_from_disk", lambda t: ((str(directory.resolve()),), {"weight_version": version})
            ).result()
        prune_versions(directory.parent, KEEP_LAST)
        return report
