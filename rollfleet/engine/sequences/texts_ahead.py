"""Running samples' texts decoded ahead of their end, on the texts thread, beside the decode steps.

A GRPO wave's samples end together, and their texts were all decoded at that last step: 512 x 256
tokens, 14-22 ms of the engine thread waiting for the texts thread on an H100 host, the largest part
of the time from the last step to every answer. Decoded as they grow, in pieces, only the last
few tokens of each are left for the end.

A piece is exact where the tokenizer's decoder turns each token into text by itself, with context
from the token before at most: ByteLevel (GPT-2, Qwen, Llama 3: bytes per token, then UTF-8) and
Metaspace (SentencePiece's U+2581 as a space, the first token's stripped). A piece of ids[a:b] is
decoded with the token before it as context, ids[a-1:b], and kept as that text past the context's
own text, where the context's text is not empty (a skipped special token gives none: the token
after it would decode as a first token) and is a prefix of the whole, and the piece does not end in
U+FFFD (a UTF-8 sequence cut between tokens: its bytes join the next piece's), so every kept piece
ends where a character ends and the next piece's context is exactly the bytes before it (a context
token that ends a character begun earlier decodes alone to U+FFFD, as its own prefix of the whole).
Otherwise the piece is not kept, and the sample's next piece (or its end) starts from the same place.
At the end the tail is decoded the same way; if its context fails the check, the whole text is
decoded afresh. Other decoders, and tokenizers whose decode does more than the Rust backend's
(`backend_decodes_alone`), decode at the end as before.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future

log = logging.getLogger("rollfleet.engine")

AHEAD_TOKENS = 8192  # new output tokens in the running set at which their texts are decoded ahead
LOCAL_DECODERS = frozenset({"ByteLevel", "Metaspace"})
CUT = "\ufffd"  # what a UTF-8 sequence cut between tokens decodes to


def decodes_ahead(tokenizer) -> bool:
    """Whether pieces of `tokenizer`'s texts join into the text of the whole (module docstring)."""
    if tokenizer is None or not backend_decodes_alone(tokenizer):
        return False
    return type(tokenizer._tokenizer.decoder).__name__ in LOCAL_DECODERS


def backend_decodes_alone(tokenizer) -> bool:
    """Whether `tokenizer._decode(ids)` is its Rust backend's `decode(ids)` and nothing more."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
        and hasattr(getattr(tokenizer, "_tokenizer", None), "decode_batch")
    )


def piece_texts(backend, rows: list[tuple[list[int], bool]], skip: bool, at_end: bool) -> list[str | None]:
    """The text of each row's ids past its context (`(ids, with_context)`: ids[0] is the token before
    the piece when `with_context`), in one call of the Rust backend; None where it is not exact (module
    docstring). `at_end`: the piece ends the text, so a trailing U+FFFD is the text's own."""
    heads = [ids[:1] for ids, context in rows if context]
    decoded = backend.decode_batch([ids for ids, _ in rows] + heads, skip_special_tokens=skip)
    texts, head_at = [], len(rows)
    for index, (_, context) in enumerate(rows):
        whole, head = decoded[index], ""
        if context:
            head, head_at = decoded[head_at], head_at + 1
            if not head or not whole.startswith(head):
                texts.append(None)
                continue
        texts.append(None if whole.endswith(CUT) and not at_end else whole[len(head) :])
    return texts


def rows_from(upto: int, ids: list[int], end: int) -> tuple[list[int], bool]:
    """`ids[upto:end]` (past a sample's text decoded ahead), with the token before them as context."""
    return (ids[upto - 1 : end], True) if upto else (ids[:end], False)


class TextsAhead:
    """The scheduler's decode steps call `step(running)`; every AHEAD_TOKENS new tokens the running
    samples' new pieces go to the texts thread (one job at a time), and a job's pieces join their
    samples at a later step, on the engine thread (the only one that writes `ahead_text`)."""

    def __init__(self, tokenizer, executor: Executor):
        self.backend, self.executor = tokenizer._tokenizer, executor
        self.due = 0  # tokens made since the last job
        self.pending: tuple[Future, list] | None = None
        self.pieces = 0  # kept so far (for tests and stats)

    def step(self, running: list) -> None:
        if self.pending is not None and self.pending[0].done():
            self._join(*self.pending)
            self.pending = None
        self.due += len(running)
        if self.due >= AHEAD_TOKENS and self.pending is None:
            self.due = 0
            self._submit(running)

    def _submit(self, running: list) -> None:
        jobs = []
        for skip in (False, True):
            # a streamed sample's text goes out as it grows already (http/streaming.py): not twice
            seqs = [
                s
                for s in running
                if s.finish is None and s.on_token is None and bool(s.params.skip_special_tokens) == skip
            ]
            ends = [(seq, len(seq.output_ids)) for seq in seqs if len(seq.output_ids) > seq.ahead_upto]
            rows = [rows_from(seq.ahead_upto, seq.output_ids, end) for seq, end in ends]
            if ends:
                jobs.append((ends, rows, skip))
        if jobs:
            future = self.executor.submit(self._decode, jobs)
            self.pending = (future, jobs)

    def _decode(self, jobs) -> list[list[str | None]]:
        return [piece_texts(self.backend, rows, skip, at_end=False) for _, rows, skip in jobs]

    def _join(self, future: Future, jobs) -> None:
        try:
            done = future.result()
        except Exception:  # noqa: BLE001 - nothing is kept: the texts decode at the end, as without this
            log.exception("decoding texts ahead failed; they decode when their samples end")
            return
        for (ends, _, _), texts in zip(jobs, done):
            for (seq, end), text in zip(ends, texts):
                if text is not None:
                    seq.ahead_text += text
                    seq.ahead_upto = end
                    self.pieces += 1
