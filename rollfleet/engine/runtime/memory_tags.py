"""Which memory tags are released now: SGLang 0.5.23's scheduler-side bookkeeping (`offload_tags` of
SchedulerWeightUpdaterManager), which real clients' sleep/wake cycles rely on.

SGLang keeps the released tags in a set. A release adds its tags, whatever is already there, so a
release of a tag already released succeeds: XTuner releases all tags, resumes only `weights` and
`kv_cache`, and releases all of them again at its next step, with `cuda_graph` still released. Here
such a release frees what is still held (the model's release skips what is already freed). A resume
removes its tags one by one; a tag not released makes SGLang's `set.remove` raise inside the
scheduler, which ends the server. This engine refuses that resume instead, with a 400 naming the tag
and the state, before anything changes. Tags None or [] mean all of SGLang's tags, `cuda_graph`
included (the paged path's decode graphs: under torch_memory_saver their memory is paused and
they stay captured, and come back with the next resume of cuda_graph or of kv_cache: XTuner's
cycle never names cuda_graph, which its SGLang predates, and would otherwise decode eagerly from then
on; without the saver they are dropped and captured again on demand). A disk
update while weights are released loads them (model.py) and leaves this record as it is, as on SGLang.
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

    def check_resume(self, tags: list[str]) -> None:
        missing = [tag for tag in tags if tag not in self.released]
        if missing:
            raise ValueError(
                f"resume_memory_occupation refused, nothing changed: {self._name(missing)} not currently released "
                f"({self._now()}): resume only tags a release named (SGLang 0.5.23's scheduler raises here)"
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
