"""Which loaded LoRA adapter goes first when `--max-loaded-loras` is passed: SGLang's rule.

SGLang keeps its adapters in least-recently-used order: a load puts the adapter last, and every
generate request that names one moves it last. After a successful load, while more adapters are
loaded than `--max-loaded-loras`, it unloads the first one that is not pinned, the way an unload
request does (new requests for it are refused, the requests already using it finish first). A
pinned adapter is never evicted, so a pinned load is refused when it would leave no unpinned slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class AdapterRecency:
    """Rank 0's view: adapter name -> pinned, least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, bool] = OrderedDict()

    def loaded(self, name: str, pinned: bool) -> None:
        self._order[name] = pinned
        self._order.move_to_end(name)

    def used(self, names: Iterable[str | None]) -> None:
        for name in names:
            if name in self._order:
                self._order.move_to_end(name)

    def unloaded(self, name: str) -> None:
        self._order.pop(name, None)

    def pinned_refusal(self, name: str, max_loaded: int | None) -> str | None:
        """Why loading `name` pinned is refused, if it is: every slot but one may be pinned."""
        pinned = sum(self._order.values())
        if max_loaded is None or pinned < max_loaded - 1:
            return None
        return (
            f"lora_name={name!r} pinned: {pinned} of --max-loaded-loras={max_loaded} adapters are pinned "
            "already, and one slot must stay free for eviction: load it with pinned=false, or unload a pinned one"
        )

    def victim(self, loaded: Iterable[str]) -> str | None:
        """The least recently used adapter of `loaded` that is not pinned."""
        loaded = set(loaded)
        return next((name for name, pinned in self._order.items() if name in loaded and not pinned), None)

    def order(self) -> list[str]:
        return list(self._order)
