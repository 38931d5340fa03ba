"""After a sync: does each engine hold exactly what was sent, at the version that was sent? For a
LoRA sync: exactly the adapter's tensors, under the adapter's name."""

from __future__ import annotations

import asyncio

from rollfleet.weights.transports.base import SyncReport
from rollfleet.weights.transports.lora import LoraSyncReport
from rollfleet.wire.client import EngineClient, EngineError
from rollfleet.wire.fingerprint import mismatches


async def find_unverified(
    report: SyncReport, clients: dict[int, EngineClient], mode: str = "fingerprint"
) -> dict[int, str]:
    """Engine id -> what is wrong, for every engine of the report that does not match it.

    mode "fingerprint": the tensors' fingerprints and the version; "version": the version only
    (for engines without rollfleet's fingerprint route, i.e. SGLang: a weaker check)."""
    if mode not in ("fingerprint", "version"):
        raise ValueError(f"mode={mode!r}: use 'fingerprint' or 'version'")
    lora_name = report.lora_name if isinstance(report, LoraSyncReport) else None

    async def check(engine_id: int) -> str | None:
        expected = report.fingerprints.get(engine_id, {})
        client = clients[engine_id]
        if mode == "version":
            version = str((await client.get_model_info())["weight_version"])
            return None if version == report.version else f"version {version!r} (sent {report.version!r})"
        if lora_name is not None:
            try:  # every tensor of the adapter, so a stale extra key is caught too
                got = await client.weights_fingerprint(None, lora_name=lora_name)
            except EngineError as exc:
                return f"adapter {lora_name!r}: {exc.message}"
            info = await client.get_model_info()
            wrong = sorted(set(mismatches(expected, got)) | (set(got) - set(expected)))
        else:
            got, info = await asyncio.gather(client.weights_fingerprint(sorted(expected)), client.get_model_info())
            wrong = mismatches(expected, got)
        version = str(info["weight_version"])
        if wrong or version != report.version:
            return f"version {version!r} (sent {report.version!r}), {len(wrong)} differing tensors {wrong[:5]}"
        return None

    engine_ids = list(report.fingerprints) or report.engine_ids
    problems = await asyncio.gather(*(check(e) for e in engine_ids))
    return {e: p for e, p in zip(engine_ids, problems) if p is not None}
