"""Which memory tags are released now: SGLang's scheduler-side bookkeeping (`offload_tags`, 0.5.23's
SchedulerWeightUpdaterManager) with its state errors answered as 400s that name the tag and its state.

A release adds its tags, a resume removes them; resuming a tag that is not released (none, or another
one) and releasing a tag twice are refused, and a refused call changes nothing. Tags None or [] mean
all of SGLang's tags, `cuda_graph` included (the paged path's decode graphs: released, they are
captured again on demand after the resume), so that a client's calls are refused here exactly where
SGLang refuses them. A
disk update while weights are released loads them (model.py) and leaves this record as it is, as on SGLang.
"""

from __future__ import annotations

ALL_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang.srt.constants GPU_MEMORY_ALL_TYPES


class ReleasedTags:
    """Rank 0's record; read and changed on the engine thread only (the control actions run there)."""

    def __init__(self):
        self.released: set[str] = set()

    @staticmethod
    def of(tags: list[str] | None) -> list[str]:
        """The tags a call names, in order, once each; None or [] is all of them."""
        return list(dict.fromkeys(tags or ALL_MEMORY_TAGS))

    def check_release(self, tags: list[str]) -> None:
        again = [tag for tag in tags if tag in self.released]
        if again:
            raise ValueError(
                f"release_memory_occupation refused, nothing changed: {self._name(again)} already released "
                f"({self._now()}): resume {'it' if len(again) == 1 else 'them'} first, or leave "
                f"{'it' if len(again) == 1 else 'them'} out of tags"
            )

    def check_resume(self, tags: list[str]) -> None:
        missing = [tag for tag in tags if tag not in self.released]
        if missing:
            raise ValueError(
                f"resume_memory_occupation refused, nothing changed: {self._name(missing)} not currently released "
                f"({self._now()}): resume only tags a release named"
            )

    def after_release(self, tags: list[str]) -> None:
        self.released.update(tags)

    def after_resume(self, tags: list[str]) -> None:
        self.released.difference_update(tags)

    @staticmethod
    def _name(tags: list[str]) -> str:
        return f"tag {tags[0]!r} is" if len(tags) == 1 else f"tags {tags} are"

    def _now(self) -> str:
        return f"released now: {sorted(self.released)}" if self.released else "nothing is released now"
