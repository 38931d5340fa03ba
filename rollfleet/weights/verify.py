"""After a sync: does each engine hold exactly what was sent, at the version that was sent?

Fingerprint mode asks each engine for the fingerprints of EVERY tensor it holds (of the base model,
or of the adapter for a LoRA sync) and requires the same set of names as the sender's and equal
values: a push that left a tensor out fails, as does one that changed a tensor wrongly."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from rollfleet.weights.transports.base import SyncReport
from rollfleet.wire.client import EngineClient, EngineError


async def find_unverified(
    report: SyncReport, clients: Mapping[int, EngineClient], mode: str = "fingerprint"
) -> dict[int, str]:
    """Engine id -> what is wrong, for every engine of the report that does not match it.

    mode "fingerprint": every tensor's fingerprint, the set of names, and the version; "version": the
    version only (for engines without rollfleet's fingerprint route, i.e. SGLang: a weaker check)."""
    if mode not in ("fingerprint", "version"):
        raise ValueError(f"mode={mode!r}: use 'fingerprint' or 'version'")
    checks = [_check(report, clients[e], report.fingerprints.get(e), mode) for e in report.engine_ids]
    problems = await asyncio.gather(*checks)
    return {e: p for e, p in zip(report.engine_ids, problems) if p is not None}


async def _check(report: SyncReport, client: EngineClient, expected: dict | None, mode: str) -> str | None:
    if mode == "version":
        version = str((await client.get_model_info())["weight_version"])
        return None if version == report.version else f"version {version!r} (sent {report.version!r})"
    if expected is None:
        return "the sender recorded no fingerprints for this engine"
    what = "the model" if report.lora_name is None else f"adapter {report.lora_name!r}"
    try:
        got, info = await asyncio.gather(
            client.weights_fingerprint(None, lora_name=report.lora_name), client.get_model_info()
        )
    except EngineError as exc:
        return f"{what}: fingerprints not readable ({exc.message})"
    problems = differences(expected, got)
    version = str(info["weight_version"])
    if version != report.version:
        problems.insert(0, f"version {version!r} (sent {report.version!r})")
    return f"{what}: " + "; ".join(problems) if problems else None


def differences(sent: Mapping[str, str], held: Mapping[str, str]) -> list[str]:
    """What differs between the sender's fingerprints and an engine's whole-model ones: tensors held
    but not sent (a push that left them out), sent but not held, and held with other values."""
    problems = []
    for label, names in (
        ("not sent", sorted(set(held) - set(sent))),
        ("sent but not held", sorted(set(sent) - set(held))),
        ("differing", sorted(n for n in set(sent) & set(held) if sent[n] != held[n])),
    ):
        if names:
            problems.append(f"{len(names)} tensors {label} {names[:5]}")
    return problems
