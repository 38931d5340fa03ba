"""A streamed sample's text, decoded a bounded window of tokens at a time.

Decoding the whole output for every stream chunk made a stream quadratic in its length. This
follows SGLang's incremental detokenizer (detokenizer_manager.py): a sample keeps a "surr" offset
and a read offset; each new token decodes `ids[surr:]` and `ids[surr:read]` (the tokens before
`read` give the decoder its context, e.g. a leading space) and the difference is the new text.
New text that ends in U+FFFD (a character whose bytes have not all come) is held back and
decoded again with the next token; clean new text is committed and both offsets move on.

Two things SGLang does not do, so that every chunk's text is a prefix of the finished answer's
(the concatenation of a stream's deltas is exactly the answer that was not streamed):

- while a sample may still be cut at a stop string (`stop` without `no_stop_trim`), the end of the
  committed text that begins a stop string is not shown yet: it is cut from the answer if the
  stop string completes;
- a run of tokens that keep ending in U+FFFD (bytes that never form a character) would grow the
  window without end; past HELD_TOKENS tokens, the text is committed at a token boundary a few
  tokens back where decoding both sides apart gives the same text as together (no character
  spans it, and the bytes after it settle how the bytes before it decode).
"""

from __future__ import annotations

import functools

from rollfleet.wire.protocol import SamplingParams

REPLACEMENT = "\ufffd"
HELD_TOKENS = 8  # tokens decoded past the read offset before a boundary is looked for
SETTLED_TOKENS = 3  # tokens after a forced boundary: the longest unfinished UTF-8 character has 3 bytes


class StreamText:
    """The text of one sample as its stream shows it: feed the output ids after each token."""

    def __init__(self, tokenizer, params: SamplingParams):
        self._decode = functools.partial(tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
        self._stops = () if params.no_stop_trim else tuple(params.stop_strings)
        self.committed = ""  # the text of ids[:read]: never changes with later tokens
        self._surr = self._read = 0
        self.shown = 0  # how much of `committed` the stream has shown

    @property
    def text(self) -> str:
        """What the stream has shown so far: a prefix of the finished answer's text."""
        return self.committed[: self.shown]

    def update(self, ids: list[int]) -> str:
        """Take the output ids so far (one token more than the last call) and return the text newly
        shown (possibly empty)."""
        surr_text = self._decode(ids[self._surr : self._read])
        window_text = self._decode(ids[self._surr :])
        new_text = window_text[len(surr_text) :]
        if new_text and not new_text.endswith(REPLACEMENT):
            self._commit(new_text, len(ids))
        elif len(ids) - self._read > HELD_TOKENS:
            self._commit_settled(ids, surr_text, window_text)
        before, self.shown = self.shown, len(self.committed) - self._stop_prefix()
        return self.committed[before : self.shown]

    def _commit(self, new_text: str, read: int) -> None:
        self.committed += new_text
        self._surr, self._read = self._read, read

    def _commit_settled(self, ids: list[int], surr_text: str, window_text: str) -> None:
        """Commit up to SETTLED_TOKENS before the end when that boundary splits the text cleanly."""
        boundary = len(ids) - SETTLED_TOKENS
        left, right = self._decode(ids[self._surr : boundary]), self._decode(ids[boundary:])
        if right and left + right == window_text and left.startswith(surr_text):
            self._commit(left[len(surr_text) :], boundary)

    def _stop_prefix(self) -> int:
        """The length of the longest end of the committed text that begins a stop string (and is
        shorter than it): that much could still be cut from the answer."""
        longest = max(map(len, self._stops), default=0)
        tail = self.committed[-(longest - 1) :] if longest > 1 else ""
        for size in range(len(tail), 0, -1):
            if any(stop.startswith(tail[-size:]) for stop in self._stops):
                return size
        return 0
