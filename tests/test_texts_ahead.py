"""Texts decoded ahead of a sample's end (rollfleet/engine/sequences/texts_ahead.py): pieces decoded
as the samples grow, joined with the rest at the end, give the text of the whole, for the byte-level
tokenizer (random ids cut UTF-8 sequences between tokens) and the SentencePiece-style one (the first
token's space stripped), special tokens skipped or kept; a decoder not known to join keeps the old way."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders

from rollfleet.engine.sequences import texts_ahead
from rollfleet.engine.sequences.sequence import Sequence, finished_texts
from rollfleet.engine.sequences.texts_ahead import TextsAhead, decodes_ahead, piece_texts, rows_from
from rollfleet.tiny_models import make_tokenizer, make_word_tokenizer
from rollfleet.wire.protocol import FinishReason, SamplingParams

BYTE_LEVEL = make_tokenizer()
WORDS = make_word_tokenizer(400)


def _joined(tokenizer, ids: list[int], cuts: list[int], skip: bool) -> str:
    """What TextsAhead keeps at `cuts`, then the rest at the end, as finished_texts joins them."""
    text, upto = "", 0
    for cut in sorted(set(cuts)):
        if cut <= upto or cut > len(ids):
            continue
        (piece,) = piece_texts(tokenizer._tokenizer, [rows_from(upto, ids, cut)], skip, at_end=False)
        if piece is not None:
            text, upto = text + piece, cut
    (rest,) = piece_texts(tokenizer._tokenizer, [rows_from(upto, ids, len(ids))], skip, at_end=True)
    return text + rest if rest is not None else tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=1000, deadline=None)
@given(
    tokenizer=st.sampled_from([BYTE_LEVEL, WORDS]),
    ids=st.lists(st.integers(0, 319), min_size=0, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=8),
    skip=st.booleans(),
)
def test_pieces_join_into_the_text_of_the_whole(tokenizer, ids, cuts, skip):
    assert _joined(tokenizer, ids, cuts, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_only_decoders_whose_pieces_join_decode_ahead():
    assert decodes_ahead(BYTE_LEVEL) and decodes_ahead(WORDS)
    other = make_tokenizer()
    other._tokenizer.decoder = decoders.WordPiece()  # "##" joins a token to the one before: not checked here
    assert not decodes_ahead(other)
    assert not decodes_ahead(None)


@pytest.mark.parametrize("tokenizer", [BYTE_LEVEL, WORDS], ids=["byte-level", "metaspace"])
def test_running_samples_texts_decoded_ahead_equal_their_texts_decoded_at_the_end(tokenizer, monkeypatch):
    """A wave of samples grows token by token; every 64 new tokens their pieces go to the texts thread
    (each job waited for here, as a later step would find it done); at the end their texts are the
    texts decoded whole, special tokens skipped or kept, a stop token trimmed."""
    monkeypatch.setattr(texts_ahead, "AHEAD_TOKENS", 64)
    rng = random.Random(0)
    seqs = [
        Sequence(f"r{i}", [5], SamplingParams(skip_special_tokens=i % 2 == 0), None, return_logprob=False)
        for i in range(12)
    ]
    with ThreadPoolExecutor(max_workers=1) as executor:
        ahead = TextsAhead(tokenizer, executor)
        for _ in range(60):
            for seq in seqs:
                seq.output_ids.append(rng.randrange(320))
            ahead.step(seqs)
            if ahead.pending is not None:
                ahead.pending[0].result()
    assert ahead.pieces > 0 and all(seq.ahead_upto > 0 for seq in seqs)
    for index, seq in enumerate(seqs):
        matched = seq.output_ids[-1] if index % 3 == 0 else None  # a stop token: trimmed from the text
        seq.finish = FinishReason(type="stop", matched=matched) if matched is not None else FinishReason(type="length")
    want = [tokenizer.decode(seq.text_ids(), skip_special_tokens=seq.params.skip_special_tokens) for seq in seqs]
    assert finished_texts(seqs, tokenizer) == want
