"""How requests end in the embedded engine's scheduler: a mixin of `Scheduler`, which owns the queues.

A finished sequence leaves the running set after its step (`_retire_finished`: its pages go back or
stay cached, kv/steps.py); its answer is built once, on the engine thread, and resolves its future
(`_finish`). A batch whose step raised ends every request in it as aborted with the reason, and the
engine goes on (`_fail_batch`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from rollfleet.engine.sequences.sequence import Sequence, finished_texts, wire_result
from rollfleet.engine.sequences.texts_ahead import TextsAhead, decodes_ahead
from rollfleet.wire.protocol import FinishReason

log = logging.getLogger("rollfleet.engine")
# finished tokens from which their texts are decoded on the texts thread, beside the retire: 512 answers
# of 256 tokens (a GRPO wave) took 26 ms to decode and 15 to retire here (2-core CPU), one after the other
TEXTS_THREAD_TOKENS = 8192
# the texts thread decodes a wave's texts in this many calls: the first part's answers go out while the
# next decodes; the first decodes beside the retire. Parts of 4,096 tokens (32 for 512 x 256) gave the
# last answer no sooner on the 2-core CPU (each part's return waits for the GIL)
TEXTS_PARTS = 4


class Finishing:
    """Needs from the scheduler: `_wakeup` (its condition), `running`, `batches`, `tokenizer`,
    `weight_version`, `clock`, `stats`."""

    _texts_thread: ThreadPoolExecutor | None = None  # made on first use
    _ahead: TextsAhead | bool | None = None  # False: this tokenizer's texts do not decode ahead

    def _retire_finished(self) -> None:
        """Finished sequences leave the running set (their pages go back, or stay cached), then are
        answered: a client that has its answer finds nothing of it left on the engine (its next
        /flush_cache or memory release is not refused for "requests running"). Many finished tokens
        (a GRPO wave's last step) are decoded on the texts thread while this one retires them (the
        tokenizer's Rust backend decodes without the GIL), in parts whose answers go out as each is in."""
        keep = [row for row, seq in enumerate(self.running) if seq.finish is None]
        if len(keep) == len(self.running):
            return
        done = [seq for seq in self.running if seq.finish is not None]
        parts = self._texts_of(done)
        try:
            self.batches.retire(self.running, keep)
            self.running = [self.running[row] for row in keep]
        finally:  # a retire that failed still answers them (the batch then fails as a whole: _fail_batch)
            retired = time.monotonic()
            waited = self._answer(parts)
            self.clock.update(retired_at=retired, decoded_at=retired + waited, answered_at=time.monotonic())

    def _texts_of(self, done: list[Sequence]) -> list[tuple[list[Sequence], list[str] | Future]]:
        """`done` in parts, each with its finished texts (one batch decode a part): decoded here in one
        part, or from TEXTS_THREAD_TOKENS finished tokens (fewer: the hand-off costs more than it saves)
        on the texts thread, in TEXTS_PARTS calls (in order)."""
        total = sum(len(seq.output_ids) - seq.ahead_upto for seq in done)  # what is left to decode
        if total < TEXTS_THREAD_TOKENS:
            return [(done, finished_texts(done, self.tokenizer))]
        parts, part, tokens, size = [], [], 0, -(-total // TEXTS_PARTS)
        for seq in done:
            part.append(seq)
            tokens += len(seq.output_ids) - seq.ahead_upto
            if tokens >= size or seq is done[-1]:
                parts.append((part, self._texts_executor().submit(finished_texts, part, self.tokenizer)))
                part, tokens = [], 0
        return parts

    def _texts_executor(self) -> ThreadPoolExecutor:
        if self._texts_thread is None:
            self._texts_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollfleet-texts")
        return self._texts_thread

    def _decode_ahead(self, prefill: bool) -> None:
        """After a decode step: the running samples' texts so far decode on the texts thread every
        AHEAD_TOKENS new tokens, where the tokenizer's pieces join exactly (sequences/texts_ahead.py),
        so that the wave's end has only their last tokens to decode."""
        if prefill or not self.running:
            return
        if self._ahead is None:
            self._ahead = TextsAhead(self.tokenizer, self._texts_executor()) if decodes_ahead(self.tokenizer) else False
        if self._ahead:
            self._ahead.step(self.running)
            self.stats["texts_ahead_pieces"] = self._ahead.pieces

    def _answer(self, parts: list[tuple[list[Sequence], list[str] | Future]]) -> float:
        """Answer each part once its texts are in: its answers go out (the event loop writes them)
        while the texts thread decodes the next part (the tokenizer's Rust backend drops the GIL).
        The seconds this thread waited for texts."""
        waited = 0.0
        for seqs, texts in parts:
            if isinstance(texts, Future):
                began = time.monotonic()
                texts = texts.result()
                waited += time.monotonic() - began
            for seq, text in zip(seqs, texts):
                self._finish(seq, seq.finish, text)
        return waited

    def _fail_batch(self, exc: Exception) -> None:
        log.exception("a batch of %d requests failed; they finish as aborted, the engine goes on", len(self.running))
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]
        with self._wakeup:
            failed, self.running = self.running, []
            for seq in failed:
                if seq.finish is None:  # a request that finished before the failure keeps its own reason
                    seq.finish = FinishReason(type="abort", message=f"the engine failed this batch: {reason}")
                self._finish(seq, seq.finish)
        self.batches.drop(failed)  # a failure here is the loop's own: it stops and says why

    def _finish(self, seq: Sequence, reason: FinishReason, text: str | None = None) -> None:
        """`text`: the sequence's `finished_text`, when the caller decoded it already."""
        seq.finish = reason
        if not (reason.type == "stop" and isinstance(reason.matched, str)):
            seq.text = seq.finished_text(self.tokenizer) if text is None else text
        if not seq.future.done():
            seq.future.set_result(wire_result(seq, self.weight_version, self.tokenizer))
