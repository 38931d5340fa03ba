"""Which engine speaks which protocol, from its `/get_server_info`: the embedded engine says so in
its own fields; SGLang gives its release (`version`), and what its weight-update routes accept
changed between releases (sessions since 0.5.21, `/get_weight_version` gone in 0.5.21, payload
shapes). The senders speak the releases in SUPPORTED_SGLANG and refuse others at connect."""

from __future__ import annotations

import re

SESSIONS_SINCE_SGLANG = (0, 5, 21)  # SGLang refuses tensor and distributed weight updates outside a session since
# The SGLang releases whose weight-update protocol the senders speak, proven by tests/test_sglang_contract.py
# against that release's own receiving code (Makefile: SGLANG_VERSION). Outside it a sender refuses to start.
SUPPORTED_SGLANG = ((0, 5, 21), (0, 5, 23))  # each passed the contract test (docs/architecture.md)


class UnsupportedEngine(ValueError):
    """An engine whose protocol the senders do not speak (an SGLang release outside SUPPORTED_SGLANG)."""


def is_embedded(server_info: dict) -> bool:
    return server_info.get("engine") == "rollfleet-embedded" or "rollfleet_weight_update_sessions" in server_info


def sglang_release(server_info: dict) -> tuple[int, ...]:
    """SGLang's release from `/get_server_info` (`version`); () for the embedded engine."""
    return () if is_embedded(server_info) else _release(str(server_info.get("version", "")))


def check_supported(server_info: dict, url: str = "the engine") -> None:
    """UnsupportedEngine naming the supported range when `url` runs an SGLang release the senders
    were not proven against (its payload shapes, sessions and routes differ between releases)."""
    if is_embedded(server_info):
        return
    release = sglang_release(server_info)
    low, high = SUPPORTED_SGLANG
    if not release or not low <= release[:3] <= high:
        span = f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}"
        raise UnsupportedEngine(
            f"{url} runs SGLang version={server_info.get('version')!r}; rollfleet's weight senders speak SGLang "
            f"{span} (checked against its code by tests/test_sglang_contract.py): run a release in that range"
        )


def uses_weight_update_sessions(server_info: dict) -> bool:
    """Whether an engine takes (and then needs) `/begin_weight_update` ... `/end_weight_update` around
    tensor and distributed weight updates, from its `/get_server_info`: the embedded engine says so
    (`rollfleet_weight_update_sessions`); SGLang has them from 0.5.21 on; older SGLang has no such routes."""
    if "rollfleet_weight_update_sessions" in server_info:
        return server_info["rollfleet_weight_update_sessions"] is True
    if server_info.get("engine") == "rollfleet-embedded":
        return False  # an embedded engine from before sessions: its `version` is rollfleet's, not SGLang's
    return _release(str(server_info.get("version", ""))) >= SESSIONS_SINCE_SGLANG


def _release(version: str) -> tuple[int, ...]:
    """(0, 5, 21) of "0.5.21", "0.5.21.post1" or "0.5.21rc0"; () when it is not a release number."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in match.groups()) if match else ()
