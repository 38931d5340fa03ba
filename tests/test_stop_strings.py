"""Stop strings as the engine checks them after each sampled token (next_token.StopRules), with the
byte-level tokenizer of the tiny test models: the same finish, matched string and text as searching
the whole output after each token (what the engine did before), for a bounded amount of decoding
per token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.engine.sequences.next_token import StopRules
from rollfleet.engine.sequences.sequence import Sequence, decode_ids, finished_texts
from rollfleet.engine.sequences.texts_ahead import backend_decodes_alone
from rollfleet.tiny_models import make_tokenizer, make_word_tokenizer
from rollfleet.wire.protocol import FinishReason, SamplingParams

TOKENIZER = make_tokenizer()
TEXT = "the quick brown fox jumps over the lazy dog"


class CountingTokenizer:
    """The tokenizer, counting the token ids its decodes read."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kwargs)


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def params(stop, **fields) -> SamplingParams:
    return SamplingParams(stop=stop, max_new_tokens=None, **fields)


def generate(ids: list[int], stop, tokenizer=TOKENIZER, **fields):
    """Feed `ids` one at a time as the engine appends sampled tokens: (finish reason, the sample's text,
    tokens taken), or (None, None, all of them) when no stop string matched."""
    seq = Sequence("r", [1], params(stop, **fields), None, return_logprob=False)
    rules = StopRules(frozenset(), context_length=100_000, tokenizer=tokenizer)
    for token in ids:
        seq.output_ids.append(token)
        if (finish := rules.finish_reason(seq, token)) is not None:
            return finish, seq.text, len(seq.output_ids)
    return None, None, len(ids)


def whole_output_search(ids: list[int], stop, **fields):
    """The engine's check before: decode the whole output after each token, take the first stop
    string (in the order given) that it holds, and cut the text at its first occurrence."""
    p = params(stop, **fields)
    for count in range(1, len(ids) + 1):
        text = TOKENIZER.decode(ids[:count], skip_special_tokens=p.skip_special_tokens)
        for s in p.stop_strings:
            if s in text:
                cut = text.index(s) + (len(s) if p.no_stop_trim else 0)
                return FinishReason(type="stop", matched=s), text[:cut], count
    return None, None, len(ids)


def test_a_stop_string_across_two_tokens_is_found_when_the_second_arrives():
    ids = encode(TEXT)
    pieces = [TOKENIZER.decode([token]) for token in ids]
    at = next(i for i in range(1, len(ids)) if len(pieces[i - 1]) > 1 and len(pieces[i]) > 1)
    stop = pieces[at - 1][-1] + pieces[at][0]
    assert all(stop not in piece for piece in pieces)  # only the two tokens together hold it
    finish, text, taken = generate(ids, stop)
    assert finish == FinishReason(type="stop", matched=stop) and taken == at + 1
    assert text == "".join(pieces[:at])[:-1]
    assert generate(ids, stop, no_stop_trim=True)[1] == "".join(pieces[:at]) + pieces[at][0]


def test_a_stop_string_at_the_very_start_leaves_no_text():
    ids = encode(TEXT)
    assert generate(ids, "th") == (FinishReason(type="stop", matched="th"), "", 1)
    assert generate(ids, "th", no_stop_trim=True)[1] == "th"


def test_a_prefix_at_a_token_boundary_finishes_only_once_completed():
    ids = encode(TEXT + " the fox.")
    # "fox" ends a token twice before the text goes on with "." (a prefix of the stop string each time)
    finish, text, taken = generate(ids, "fox.")
    assert finish.matched == "fox." and text == TEXT + " the " and taken == len(ids)
    # a stop string over three tokens, the first of them a prefix of it at a boundary
    finish, text, taken = generate(ids, "fox jumps o")
    assert text == "the quick brown " and TOKENIZER.decode(ids[:taken]).endswith("fox jumps o")
    assert not TOKENIZER.decode(ids[: taken - 1]).endswith("fox jumps o")


def test_the_stop_string_that_ends_first_wins_then_the_order_given():
    ids = encode(TEXT)
    assert generate(ids, ["lazy", "fox"])[:2] == (FinishReason(type="stop", matched="fox"), "the quick brown ")
    # both end with the same token: the first given is matched, and the text is cut where it starts
    assert generate(ids, ["ox", "fox"])[:2] == (FinishReason(type="stop", matched="ox"), "the quick brown f")
    assert generate(ids, ["fox", "ox"])[:2] == (FinishReason(type="stop", matched="fox"), "the quick brown ")


def test_multi_byte_characters_split_over_tokens():
    ids = encode("é€😀 the fox")  # one byte a token: each character takes two to four tokens
    assert generate(ids, "€") == (FinishReason(type="stop", matched="€"), "é", 5)
    assert generate(ids, "😀 t", no_stop_trim=True)[1:] == ("é€😀 t", 10)


def test_the_decoding_per_token_is_bounded_by_the_stop_strings_not_the_output():
    ids = encode(" ".join([TEXT] * 40))
    assert len(ids) > 400
    counting = CountingTokenizer(TOKENIZER)
    seq = Sequence("r", [1], params(["zzz", "jumps!"]), None, return_logprob=False)
    rules = StopRules(frozenset(), context_length=100_000, tokenizer=counting)
    per_token = []
    for token in ids:
        seq.output_ids.append(token)
        counting.decoded = 0
        assert rules.finish_reason(seq, token) is None
        per_token.append(counting.decoded)
    # two windows of about the longest stop string's length in tokens, however long the output
    assert max(per_token) <= 2 * (len("jumps!") + 6), max(per_token)


TEXTS = st.text(alphabet="ab é€😀.\ufffd", max_size=30).map(encode)
ANY_IDS = st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=40)  # special tokens, invalid UTF-8


@settings(max_examples=300, deadline=None)
@given(ids=st.one_of(TEXTS, ANY_IDS).filter(bool), data=st.data())
def test_same_results_as_searching_the_whole_output(ids, data):
    skip, trim = data.draw(st.booleans()), data.draw(st.booleans())
    full = TOKENIZER.decode(ids, skip_special_tokens=skip)
    cuts = st.tuples(st.integers(0, len(full)), st.integers(0, 6)).map(lambda c: full[c[0] : c[0] + c[1]])
    stops = data.draw(st.lists(st.one_of(cuts, st.text(alphabet="ab é€😀\ufffd<|>", max_size=4)), max_size=3))
    fields = {"skip_special_tokens": skip, "no_stop_trim": not trim}
    assert generate(ids, stops or None, **fields) == whole_output_search(ids, stops or None, **fields)


WORDS = make_word_tokenizer(400)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 319), max_size=40), st.booleans(), st.sampled_from(["bytes", "words"]))
def test_decode_ids_gives_the_tokenizers_own_decode(ids, skip, which):
    """The answers' and stop checks' decode (no per-id type walk) writes what `tokenizer.decode` writes,
    special tokens (ids 0-2) kept or skipped, for a byte-level BPE and a word-level tokenizer."""
    tokenizer = TOKENIZER if which == "bytes" else WORDS
    assert decode_ids(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 319), max_size=30), st.booleans(), st.booleans(), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from(["bytes", "words"]),
)
def test_a_batchs_texts_decoded_together_are_each_ones_own(samples, which):
    """The texts of a finished batch, decoded in one call of the tokenizer's backend (per skip flag),
    are each sample's `finished_text`: special tokens kept or skipped, a matched stop token trimmed
    unless no_stop_trim."""
    tokenizer = TOKENIZER if which == "bytes" else WORDS
    seqs = []
    for ids, skip, stopped, keep_stop in samples:
        seq = Sequence("r", [1], SamplingParams(skip_special_tokens=skip, no_stop_trim=keep_stop), None, False)
        seq.output_ids = list(ids)
        length = FinishReason(type="length", length=len(ids))
        seq.finish = FinishReason(type="stop", matched=ids[-1]) if stopped and ids else length
        seqs.append(seq)
    assert finished_texts(seqs, tokenizer) == [seq.finished_text(tokenizer) for seq in seqs]
    assert backend_decodes_alone(tokenizer)  # these tokenizers take the one-call path
    assert not backend_decodes_alone(CountingTokenizer(tokenizer))
