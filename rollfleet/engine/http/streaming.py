"""`stream: true`: server-sent events as SGLang sends them for /generate, and the progress feed the
OpenAI routes stream from.

SGLang (without `--incremental-streaming-output`, its default) sends one `data: {json}\n\n` event
per generated token whose `text`, `output_ids` and logprobs are cumulative (the text as far as it is
settled: stream_text.py) and whose
`meta_info.finish_reason` is null until the last event, then `data: [DONE]\n\n`. A request that
SGLang treats as a batch (several prompts, or n > 1) interleaves its samples' events and adds
`index`, the sample's place in the prompt-major answer list. A batch that fails ends its samples
with an abort finish_reason, as without streaming. A client that goes away aborts what it left running,
streamed or not (`answers`).

The engine thread calls each sequence's `on_token` after every token that did not finish it and
resolves its future when it finished; both only post to this request's queue on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from rollfleet.engine.http.service import dumps
from rollfleet.engine.http.stream_text import StreamText
from rollfleet.engine.sequences.sequence import Sequence, wire_result

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


async def progress(engine, seqs: list[Sequence]) -> AsyncIterator[tuple[int, dict, str, bool]]:
    """(index, cumulative answer, text new since the last item, finished) per token of every sequence,
    as they come; a sequence's last item is its finished answer. An unfinished answer's text is what
    its StreamText shows (a prefix of the finished text, decoded a bounded window at a time), so the
    new texts of a sequence add up to its finished answer's text. Sequences left unfinished when the
    consumer stops are aborted."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

    def post(item):
        loop.call_soon_threadsafe(queue.put_nowait, item)

    texts = [StreamText(engine.tokenizer, seq.params) for seq in seqs]
    for index, seq in enumerate(seqs):
        seq.on_token = lambda s, i=index: post((i, len(s.output_ids)))
        seq.future.add_done_callback(lambda _f, i=index: post((i, None)))
    unfinished = set(range(len(seqs)))
    try:
        while unfinished:
            index, count = await queue.get()
            seq, text = seqs[index], texts[index]
            if index not in unfinished or (count is not None and seq.future.done()):
                continue  # its finished answer is queued behind this
            if count is None:
                unfinished.discard(index)
                answer = seq.future.result()
                yield index, answer, answer["text"][len(text.text) :], True
            else:
                new_text = text.update(seq.output_ids[:count])
                version = engine.scheduler.weight_version
                yield index, wire_result(seq, version, engine.tokenizer, upto=count, text=text.text), new_text, False
    finally:
        engine.scheduler.abort_sequences([seqs[index] for index in unfinished], "the client closed the stream")


async def answers(engine, request, seqs: list[Sequence]) -> list[dict]:
    """The finished answers of `seqs`, for an answer that is not streamed. A client that went away
    (a timeout, a closed connection) aborts what it left unfinished, as SGLang does, instead of
    leaving it to run to its end and hold its rid."""
    gathered = asyncio.ensure_future(_all_done(seqs))
    gone = asyncio.ensure_future(_disconnect(request))  # request.is_disconnected() never sees it behind middleware
    try:
        await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not gathered.done():
        engine.scheduler.abort_sequences(seqs, "the client went away")
    return await gathered


async def _all_done(seqs: list[Sequence]) -> list[dict]:
    """The answers of `seqs` once every one is done, the event loop woken once for them: the engine
    thread resolves a finished batch's futures in a row, and a wake-up each (`wrap_future`) cost it
    2.5-4.7 ms for 512 (0.5 with one per request), the loop 7-11 ms until the last was seen (2-3)."""
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    left, lock = [len(seqs)], threading.Lock()

    def one(_future) -> None:  # on the engine thread (or here, for a future already done)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not loop.is_closed():
            loop.call_soon_threadsafe(done.set)

    for seq in seqs:
        seq.future.add_done_callback(one)
    if seqs:
        await done.wait()
    return [seq.future.result() for seq in seqs]


async def _disconnect(request) -> None:
    """Return once the client has disconnected (the request's body was read before: only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(1)  # not expected; wait on without spinning


def stream_response(engine, seqs: list[Sequence], indexed: bool) -> StreamingResponse:
    """SGLang's /generate stream of `seqs`; `indexed`: add each sample's `index` (a batch request)."""

    async def events():
        async for index, answer, _new_text, _finished in progress(engine, seqs):
            yield sse({**answer, "index": index} if indexed else answer)
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")
