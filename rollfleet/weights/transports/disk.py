"""disk: the sender writes a HF directory per version; engines load it with /update_weights_from_disk.

Directories are `<path>/version-<v>`; the newest `keep_last` stay (recovery restores from them)."""

from __future__ import annotations

from pathlib import Path

from rollfleet.weights.checkpoint import prune_versions, save_checkpoint
from rollfleet.weights.source import WeightSource
from rollfleet.weights.transports.base import SyncReport, Transport, register, timed

KEEP_LAST = 2


def version_dir(root: str | Path, version: str) -> Path:
    return Path(root) / f"version-{version}"


@register
class DiskTransport(Transport):
    name = "disk"

    def __init__(self, spec, targets, *, config_dir: str | None = None, **kwargs):
        super().__init__(spec, targets, **kwargs)
        self.config_dir = config_dir

    def send(self, source: WeightSource, version: str) -> SyncReport:
        report, collectors = self._new_report(version), self._collectors()
        directory = version_dir(self.spec.path, version)
        with timed(report):
            save_checkpoint(self._recorded(source, report, collectors), directory, self.config_dir)
            self._finish_fingerprints(report, collectors)
            self.calls.each(
                "update_weights_from_disk", lambda t: ((str(directory.resolve()),), {"weight_version": version})
            ).result()
        prune_versions(directory.parent, KEEP_LAST)
        return report
