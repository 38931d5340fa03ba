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
With tensors they are sampled from the packed bucket (one gather per dtype, `staging.PackPlan`).

Fixed costs, kept small: the adapter's tensors are read by a plan made once per model and adapter
(weights/adapter.py: peft's state dict walks every module, 12 ms per sync on the CPU); the bucket's
layout is planned once per run (`PackPlans`) and packed in one multi-tensor copy, into the last
sync's buffer where every engine says it copies adapters at load (`rollfleet_lora_copied_at_load` in
/get_server_info: the embedded engine, which keeps the last payload referenced, so the buffer's CUDA
IPC handle stays open there), else into a fresh one (an engine that reads a loaded adapter in place
needs the old version's buffer unchanged while it is loaded); where every engine also says
`rollfleet_lora_resident`, that buffer is mapped into them once and later loads name its id alone
(adapter_mapping.py: nothing serialized per sync; a restarted engine is sent the buffer again); the
fingerprint samples are gathered from the bucket before the load and hashed while the engines load;
the adapter directory is written in a thread once every engine took the version, off the sync's path
(the train step runs meanwhile), from the packed bucket (one copy to the host:
`save_packed_adapter`), which holds the values as pushed while the trainer may step its parameters
as soon as the sync returns, and which is repacked only after that write ended (the next sync waits
for it first, `_wait_saved`; a restore that asks for it meanwhile waits, within its deadline, for
its partial directory's rename: `saved_adapter`, the partial being made before the sync returns). On
an H100 the write of a 135 MB adapter, 43-45 ms, was most of the in-loop sync when it was inline,
and when it ran beside the engines' load it shared the sender's process (its GIL, its host copies)
with the push. A failed sync writes nothing; a version resent over its own directory replaces it
only after the engines took it. The listing of loaded adapters is asked for first and waited for
after the pack and serialization; it names, besides a copy of this version left by a failed sync,
the old versions, unloaded at once with the version call (one round trip). `SyncReport.phases` has
save (the wait for the last sync's directory; with source=directory the write itself, which the
engines read), source, pack, fingerprint, serialize, unload_retried (the wait for the listing, and
the unload of a retried copy), load, versions (version, unloads). The old versions' directories are
pruned after the sync returns, in the writing thread (46-120 ms of the sync on an H200's disk when
it was inline). A sync to ONE engine that says `rollfleet_lora_load_then_version` (the embedded
engine) has no versions phase: its load call carries the version and the old names, applied once
the adapter is loaded (one round trip instead of two); with several engines each keeps the old
version until every one has loaded, so a sync that fails part-way leaves them all serving it."""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from rollfleet.weights.adapter import AdapterSource, SavedAdapter, save_adapter, save_packed_adapter
from rollfleet.weights.checkpoint import begin_partial, partial_of, prune_versions
from rollfleet.weights.transports.adapter_mapping import AdapterMapping
from rollfleet.weights.transports.base import SyncReport, Transport, register, timed
from rollfleet.weights.transports.disk import version_dir
from rollfleet.weights.transports.staging import PackPlan, PackPlans, call_bytes, payload_buffer, wait_all
from rollfleet.wire.buckets import Bucket
from rollfleet.wire.fingerprint import Fingerprints, fingerprints
from rollfleet.wire.handoffs import prompt_handoffs

KEEP_LAST = 2
SAVE_POLL_S = 0.005  # how often a restore looks for a directory still being written
log = logging.getLogger("rollfleet.weights")


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
    def saved_adapter(cls, spec, version: str, *, wait_s: float = 0.0, sleep=time.sleep) -> str | None:
        """The adapter directory a sync of `version` left, while it is kept. A sync returns while its
        directory is still being written (`<dir>.partial`, renamed when whole: `writing_adapter`);
        with `wait_s` a restore waits that long at most for the rename (`sleep`: how it waits
        between looks)."""
        directory = version_dir(spec.path, version)
        waited = 0.0
        while not (directory / SavedAdapter.WEIGHTS_FILE).is_file() and waited < wait_s:
            if not cls.writing_adapter(spec, version):
                break
            sleep(SAVE_POLL_S)
            waited += SAVE_POLL_S
        return str(directory.resolve()) if (directory / SavedAdapter.WEIGHTS_FILE).is_file() else None

    @classmethod
    def writing_adapter(cls, spec, version: str) -> bool:
        """Whether the adapter directory of `version` is being written (its `.partial` is there)."""
        return partial_of(version_dir(spec.path, version)).is_dir()

    def __init__(self, spec, targets, **kwargs):
        super().__init__(spec, targets, **kwargs)
        self.plans = PackPlans()  # the adapter's layout, the same every sync
        self._buffer: torch.Tensor | None = None  # reused while every engine copies adapters at load
        self._reuse = False
        self._resident = False  # and every engine takes the buffer's mapping once, then its id (adapter_mapping.py)
        self._folds = False  # one engine, which sets the version and unloads the old ones in the load's call
        self.mapping = AdapterMapping()
        self._writer: ThreadPoolExecutor | None = None  # writes the adapter directory while engines load
        self._saving: tuple[str, Future] | None = None  # the last good sync's directory, maybe still being written

    def disconnect(self) -> None:
        self._wait_saved()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        super().disconnect()

    def _server_infos(self) -> list[dict]:
        infos = super()._server_infos()
        self._reuse = all(info.get("rollfleet_lora_copied_at_load") is True for info in infos)
        self._resident = (
            self._reuse and self.spec.resident and all(info.get("rollfleet_lora_resident") is True for info in infos)
        )
        self._folds = len(infos) == 1 and infos[0].get("rollfleet_lora_load_then_version") is True
        return infos

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
        with timed(report), prompt_handoffs():
            with timed(report, "save"):  # the last sync's directory (written long ago, as a rule)
                self._wait_saved()
            with timed(report, "source"):
                tensors = list(source.named_tensors())
                config = source.config_dict()
            report.tensors = len(tensors)
            report.bytes = sum(t.numel() * t.element_size() for _, t in tensors)
            listing = self._each("loaded_lora_adapters", lambda t: ((), {}))  # answered while this rank packs
            bucket, then = None, None
            if source.directory is not None:  # a saved adapter (a restore): the engines read it
                self._fingerprint(report, tensors)
                self._unload_retried(listing, name, report)
                self._load_directory(name, source.directory, report)
            elif self.spec.source == "directory":
                self._fingerprint(report, tensors)
                self._unload_retried(listing, name, report)
                with timed(report, "save"):
                    directory = save_adapter(tensors, config, version_dir(self.spec.path, version))
                self._load_directory(name, directory, report)
            else:
                bucket, prints, plan = self._packed(report, tensors)
                with timed(report, "serialize"):  # one dict per entry, serialized once per engine rank, or an id
                    entries = self.mapping.entries(bucket, self._buffer, plan, self.targets, self._resident)
                self._unload_retried(listing, name, report)
                if self._folds:  # the load's call sets the version and unloads the old ones (one round trip)
                    then = {"weight_version": version, "unload_lora_names": self._old(name, listing.result()[0])}
                self._load_tensors(name, entries, config, prints, report, bucket, then)
            if then is None:
                with timed(report, "versions"):
                    self._set_version_and_unload_old(name, version, listing.result())
            if bucket is not None:  # what a restarted engine restores from, written off the sync's path
                self._save_after(bucket, config, version)
        if source.directory is None:  # off the sync's path: after this version's directory, in the same thread
            self._writing().submit(_prune, Path(self.spec.path))
        return report

    def settle(self) -> None:
        self._wait_saved()

    def _wait_saved(self) -> None:
        """Wait for the directory the last good sync is writing; a failure to write it is logged (that
        sync had succeeded: its engines hold the version; a restarted engine cannot restore it)."""
        if self._saving is None:
            return
        (version, saving), self._saving = self._saving, None
        try:
            saving.result()
        except Exception as exc:  # noqa: BLE001  (reported, not raised: see above)
            log.warning("writing the adapter directory of version %s failed: %s", version, exc)
            shutil.rmtree(partial_of(version_dir(self.spec.path, version)), ignore_errors=True)  # none waits on it

    def _fingerprint(self, report: SyncReport, tensors) -> None:
        with timed(report, "fingerprint"):
            prints = fingerprints(tensors)
        report.fingerprints = {t.engine_id: dict(prints) for t in self.targets}

    def _packed(self, report: SyncReport, tensors) -> tuple[Bucket, Fingerprints, PackPlan]:
        """The adapter as one flattened bucket in a fresh buffer (the trainer's own parameter storages
        never become shared memory), and its fingerprint samples, gathered from the bucket (hashed
        while the engines load it: `_load_tensors`)."""
        device = tensors[0][1].device if tensors else torch.device("cpu")
        with timed(report, "pack"):
            plan = self.plans.plan(tensors)
            buffer = self._take_buffer(call_bytes(tensors), device)  # (settles `_reuse`)
            bucket = plan.pack(tensors, buffer, keep_views=self._reuse)  # the same buffer again: its views
        with timed(report, "fingerprint"):
            prints = Fingerprints()
            plan.fingerprint(bucket, prints)
            if device.type == "cuda":  # the pack is finished before an engine reads the bucket
                torch.cuda.current_stream(device).synchronize()
        return bucket, prints, plan

    def _take_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The bucket's memory: the last sync's again where every engine copies adapters at load
        (its IPC handle, or shared memory on the CPU, is already open there), else a fresh one."""
        if self.session_engines is None:
            self._server_infos()
        buffer = self._buffer
        if not self._reuse or buffer is None or buffer.device != device or buffer.numel() < nbytes:
            buffer = payload_buffer(nbytes, device)  # (on the CPU in shared memory: the writer reads it)
            self._buffer = buffer if self._reuse else None
        return buffer[:nbytes]

    def _save_after(self, bucket: Bucket, config: dict, version: str) -> None:
        """This version's adapter directory, written from `bucket` in the writing thread once every
        engine took the version (a failed sync leaves none; a version resent over its own directory
        replaces it only now). Its `.partial` is made here, before this returns, so that a restore
        asking for it from now on waits for the rename (`saved_adapter`). A write that cannot start
        is logged: the sync has succeeded, only a restarted engine cannot restore this version."""
        directory = version_dir(self.spec.path, version)
        try:
            begin_partial(directory)
        except OSError as exc:
            log.warning("writing the adapter directory of version %s failed: %s", version, exc)
            return
        saving = self._writing().submit(save_packed_adapter, bucket, config, directory, begun=True)
        self._saving = (version, saving)  # the next sync (or a restore) waits for it

    def _writing(self) -> ThreadPoolExecutor:
        """The one thread that writes adapter directories and prunes old ones, in the order asked."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollfleet-adapter-save")
        return self._writer

    def _load_directory(self, name: str, directory, report: SyncReport) -> None:
        with timed(report, "load"):
            self._each("load_lora_adapter", lambda t: ((name, str(Path(directory).resolve())), {})).result()

    def _load_tensors(self, name: str, entries: dict, config: dict, prints: Fingerprints, report, bucket, then) -> None:
        """`entries`: engine id -> (load_format, one serialized dict per rank, as SGLang's tp worker
        indexes it: `data["flattened_tensor"]`, or the adapter mapping's entries); the fingerprints
        are hashed while the engines load (an engine that does not hold the mapping it was named is
        sent the bucket under it: `AdapterMapping.answered`). `then`: what the one engine does once it
        loaded (the version, the old adapters to unload), or None."""

        def load(engine_id: int, how: tuple[str, list[str]]) -> Future:
            return self._each(
                "load_lora_adapter_from_tensors",
                lambda t: ((name, config, how[1]), {"load_format": how[0], **(then or {})}),
                [engine_id],
            )

        loading = {engine_id: load(engine_id, how) for engine_id, how in entries.items()}
        with timed(report, "fingerprint"):
            try:
                digests = prints.digests()
            except BaseException:
                wait_all(*loading.values())  # no call left in flight behind the error
                raise
        report.fingerprints = {t.engine_id: dict(digests) for t in self.targets}
        with timed(report, "load"):
            targets = {t.engine_id: t for t in self.targets}
            error = self.mapping.answered(loading, entries, lambda e: load(e, self.mapping.carried(bucket, targets[e])))
        if error is not None:
            raise error

    def _set_version_and_unload_old(self, name: str, version: str, listed: list[dict]) -> None:
        """The version on every engine, and the run's other versions unloaded, all at once. `listed`:
        each engine's adapters when the sync began (the only version loaded since is `name`; a copy
        of `name` listed then was unloaded before the load: `_unload_retried`)."""
        setting = self._each("update_weight_version", lambda t: ((version,), {}))
        unloading = [
            self._each("unload_lora_adapter", lambda t, n=old: ((n,), {}), engine_ids=[target.engine_id])
            for target, names in zip(self.targets, listed)
            for old in self._old(name, names)
        ]
        error = wait_all(setting, *unloading)
        if error is not None:
            raise error

    def _old(self, name: str, listed) -> list[str]:
        """The run's other versions among an engine's `listed` adapters: unloaded once `name` is loaded."""
        return [old for old in listed if old != name and is_version_of(old, self.spec.adapter_name)]

    def _unload_retried(self, listing: Future, name: str, report: SyncReport) -> None:
        """Unload a copy of `name` wherever `listing` (each engine's loaded adapters, /v1/models as
        SGLang lists them) shows one: left by a sync of this very version that failed part-way."""
        with timed(report, "unload_retried"):
            unloading = [
                self._each("unload_lora_adapter", lambda t: ((name,), {}), engine_ids=[target.engine_id])
                for target, names in zip(self.targets, listing.result())
                if name in names
            ]
            error = wait_all(*unloading)
        if error is not None:
            raise error


def served_name(adapter_name: str, version: str) -> str:
    """The name the engines serve version `version` of the run's adapter under (lora_path of generate)."""
    return f"{adapter_name}-v{version}"


def is_version_of(name: str, adapter_name: str) -> bool:
    return name.startswith(f"{adapter_name}-v")


def _prune(root: Path) -> None:
    """The writing thread's prune: a failure is logged (the sync it follows has succeeded)."""
    try:
        prune_versions(root, KEEP_LAST)
    except OSError as exc:
        log.warning("pruning old adapter versions under %s failed: %s", root, exc)
