"""PeerRestore: the first restore source. A running engine of the fleet at the fleet's version (a
"seed"; every engine of a fleet has the same layout) sends its weights to the engine being restored
over SGLang's R-Fork (docs/architecture.md "R-Fork"): no disk, no trainer.

- Embedded engines: the restored engine pulls with `/rollfleet/load_from_remote_instance`; the group
  ports are picked by the seed's own worker (they must be free on the seed's host). One destination
  per seed at a time: several engines are spread over the seeds, those sharing a seed pull one after
  another. Each pull's timeouts come from the restore's deadline. A pull that fails (the seed died,
  say) fails only its engine (`SyncReport.failed`); Recovery then tries the next source.
- Verification: the seed's own fingerprints (`/rollfleet/weights_fingerprint`, read before the pull;
  no push overlaps a restore, so they stay the fleet version's) and its version.
- SGLang pulls only at start: `start_seeds` gives engines being restarted a `RemoteSeed`; `restore`
  then labels those that came up with the seed's version and verifies the version (SGLang has no
  fingerprints). Untested against a real SGLang here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from urllib.parse import urlsplit

import ray

from rollfleet.config import RunConfig
from rollfleet.engine.process.launch import RemoteSeed
from rollfleet.fleet.lifecycle import EngineSlot, EngineState
from rollfleet.weights.transports import SyncReport
from rollfleet.weights.transports.base import transport_class
from rollfleet.wire.client import EngineClient
from rollfleet.wire.errors import EngineError, EngineUnreachable
from rollfleet.wire.pool import EnginePool


class PeerRestore:
    name = "peer"

    def __init__(self, cfg: RunConfig, slots: list[EngineSlot], pool: EnginePool):
        self.cfg, self.rollout, self.slots, self.pool = cfg, cfg.rollout, slots, pool
        self._lock = threading.Lock()
        self._seeding: set[int] = set()  # engine ids seeding a restore now (one destination each)
        self._pulled_at_start: dict[str, str] = {}  # SGLang: url of an engine started from a seed -> version
        self._devices: dict[int, str] = {}  # engine id -> the device its engine runs on ("cuda" or "cpu")

    def seeds(self, version: str, dest: EngineSlot | None = None) -> list[EngineSlot]:
        """ACTIVE engines verified at `version` that seed nothing now (and, given `dest`, can send to it)."""
        with self._lock:
            busy = set(self._seeding)
        return [
            s
            for s in self.slots
            if s.state == EngineState.ACTIVE
            and s.version == version
            and s.engine_id not in busy
            and (dest is None or self.can_send(s, dest))
        ]

    def can_send(self, seed: EngineSlot, dest: EngineSlot) -> bool:
        """NCCL takes one rank per GPU in a group, so a seed sharing a GPU with a destination on CUDA (a
        standby beside an engine) cannot send to it; gloo (engines on the CPU) can."""
        return not (set(seed.gpu_ids) & set(dest.gpu_ids)) or not self._on_cuda(dest)

    def _on_cuda(self, slot: EngineSlot) -> bool:
        if not self.rollout.use_gpu:
            return False
        if slot.engine_id not in self._devices:

            async def ask() -> dict:  # a client of its own: a short timeout, not the pool's
                async with EngineClient(slot.url, **self.rollout.keys, timeout=5) as client:
                    return await client.get_server_info()

            try:
                info = self.pool.run(ask())
            except (EngineUnreachable, EngineError):
                return True  # not known yet: assume NCCL
            self._devices[slot.engine_id] = info.get("device", "cuda")  # SGLang serves on GPUs
        return self._devices[slot.engine_id] == "cuda"

    def available(self, version: str, slot: EngineSlot) -> bool:
        # a LoRA run moves only the adapter: a seed sends base weights, so the adapter would be missing
        if not transport_class(self.cfg.weight_sync).sends_full_weights:
            return False
        if self.rollout.backend == "sglang":
            return self._pulled_at_start.get(slot.url) == version
        return bool(self.seeds(version, slot))

    def _take(self, version: str, count: int) -> list[EngineSlot]:
        with self._lock:
            chosen = [s for s in self.slots if s.state == EngineState.ACTIVE and s.version == version]
            chosen = [s for s in chosen if s.engine_id not in self._seeding][:count]
            self._seeding.update(s.engine_id for s in chosen)
        return chosen

    def _release(self, seeds: list[EngineSlot]) -> None:
        with self._lock:
            self._seeding.difference_update(s.engine_id for s in seeds)

    def restore(self, slots: list[EngineSlot], version: str, deadline: float) -> SyncReport:
        report = SyncReport(version=version, transport="peer", engine_ids=[s.engine_id for s in slots])
        if self.rollout.backend == "sglang":
            return self._label_pulled_at_start(slots, version, report)
        seeds = self._take(version, len(slots))
        if not seeds:
            raise RuntimeError(f"no ACTIVE engine at version {version!r} is free to seed a restore")
        try:
            chains = _assign(seeds, slots, report, self.can_send)

            async def every():
                await asyncio.gather(*(self._chain(seed, chain, version, deadline, report) for seed, chain in chains))

            self.pool.run(every())
        finally:
            self._release(seeds)
        return report

    async def _chain(
        self, seed: EngineSlot, chain: list[EngineSlot], version: str, deadline: float, report: SyncReport
    ) -> None:
        """One seed's destinations, one after another; what each must report goes into `report`."""
        try:
            # a third of what is left: a hung seed leaves the next source time within the deadline
            wait_s = max(0.1, (deadline - time.monotonic()) / 3)
            prints = await asyncio.wait_for(self._seed_prints(seed, version), wait_s)
        except Exception as exc:  # noqa: BLE001 - the seed failed: so did every pull it was to serve
            report.failed.update({d.engine_id: f"seed engine {seed.engine_id}: {exc!r:.300}" for d in chain})
            return
        for index, dest in enumerate(chain):
            # each pull's join and broadcast are bounded by timeout_s: ~2 per pull, the rest shared
            timeout_s = max(1.0, (deadline - time.monotonic()) / (2 * (len(chain) - index) + 1))
            try:
                await self._pull(seed, dest, timeout_s)
                report.fingerprints[dest.engine_id] = prints
            except Exception as exc:  # noqa: BLE001 - this engine's pull failed; it alone is not restored
                report.failed[dest.engine_id] = f"pull from seed engine {seed.engine_id} failed: {exc!r:.300}"

    async def _seed_prints(self, seed: EngineSlot, version: str) -> dict[str, str]:
        """What a destination must then hold: the seed's fingerprints ({} in version mode), checking
        that the seed really holds `version`."""
        client = self.pool.client(seed.engine_id)
        held = str((await client.get_model_info())["weight_version"])
        if held != version:
            raise RuntimeError(f"seed engine {seed.engine_id} holds version {held!r}, not {version!r}")
        return await client.weights_fingerprint(None) if self.cfg.verify_mode == "fingerprint" else {}

    async def _pull(self, seed: EngineSlot, dest: EngineSlot, timeout_s: float) -> None:
        tp = self.rollout.layout.tp_size
        ports = await asyncio.to_thread(ray.get, seed.head.free_ports.remote(tp), timeout=timeout_s)
        where = urlsplit(seed.url)
        answer = await self.pool.client(dest.engine_id).load_from_remote_instance(
            where.hostname,
            where.port,
            ports,
            group_name=f"rollfleet_peer_{seed.engine_id}_to_{dest.engine_id}",
            timeout_s=timeout_s,  # backend: the destination's own (nccl on GPU, gloo on CPU)
        )
        if not answer.get("success", False):
            raise RuntimeError(answer.get("message", answer))

    # ---- SGLang: the pull happens at start --------------------------------------------------------
    def start_seeds(self, slots: list[EngineSlot], version: str) -> dict[int, RemoteSeed]:
        """SGLang only: a seed for each engine about to be restarted (at most one per seed), reserved
        until `started`; {} for the embedded engine (it pulls while running, in `restore`)."""
        if self.rollout.backend != "sglang" or not self.available_for_start():
            return {}
        seeds = self._take(version, len(slots))
        tp = self.rollout.layout.tp_size
        try:
            ports = ray.get([s.head.free_ports.remote(tp) for s in seeds], timeout=60)
        except ray.exceptions.RayError:  # a seed's worker is gone: these engines start without one
            self._release(seeds)
            return {}
        return {
            dest.engine_id: RemoteSeed(urlsplit(s.url).hostname, urlsplit(s.url).port, tuple(p))
            for dest, s, p in zip(slots, seeds, ports)
        }

    def available_for_start(self) -> bool:
        return transport_class(self.cfg.weight_sync).sends_full_weights

    def started(self, seeds: dict[int, RemoteSeed], up: list[EngineSlot], version: str) -> None:
        """The starts are over: the seeds are free again; the engines that came up pulled `version`."""
        with self._lock:
            self._seeding.clear()
        for slot in up:
            if slot.engine_id in seeds:
                self._pulled_at_start[slot.url] = version

    def _label_pulled_at_start(self, slots: list[EngineSlot], version: str, report: SyncReport) -> SyncReport:
        """SGLang names no version on a weight load at start: label the engines that pulled the seed's
        weights with the seed's version; the version check then sees them answer with it."""
        for slot in slots:
            if self._pulled_at_start.pop(slot.url, None) == version:
                self.pool.call(slot.engine_id, "update_weight_version", version)
            else:
                report.failed[slot.engine_id] = "not started from a seed at this version"
        return report


def _assign(seeds: list[EngineSlot], dests: list[EngineSlot], report: SyncReport, can_send) -> list[tuple]:
    """(seed, its destinations) with each destination on the least loaded seed that can send to it; a
    destination no seed can reach fails in `report` (the next restore source takes it)."""
    chains = {seed.engine_id: (seed, []) for seed in seeds}
    for dest in dests:
        able = [chains[s.engine_id] for s in seeds if can_send(s, dest)]
        if not able:
            report.failed[dest.engine_id] = "no seed on another GPU: NCCL cannot send between ranks on one GPU"
            continue
        min(able, key=lambda chain: len(chain[1]))[1].append(dest)
    return [(seed, chain) for seed, chain in chains.values() if chain]
