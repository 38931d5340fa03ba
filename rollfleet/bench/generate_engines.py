"""One engine of `rollfleet bench generate` on one case, in a process of its own (the benchmark starts
one per engine and case, so no GPU memory or allocator state passes from one to the next).

    python -m rollfleet.bench.generate_engines ENGINE --model DIR --prompts FILE --n 8 --new-tokens 256 \
        --repeats 2 --device cuda --dtype bfloat16 --out FILE.json

ENGINE is one of:
- embedded: `python -m rollfleet.engine.process.server` started from here (forked from a shared zygote where
  the environment names one, else spawned), driven over HTTP as a GRPO step drives it: one /generate
  per prompt with `input_ids`, sampling_params n, max_new_tokens, temperature 1, ignore_eos, and
  return_logprob, all sent at once so the engine batches them (with --logprob-values the logprobs come
  as one list a sample, return_logprob_values, as rollfleet's GRPO driver asks for them);
- embedded_batch: the same server and sampling, ONE /generate of every prompt (`input_ids` a list):
  what the per-request path costs beyond the same tokens asked for at once;
- embedded_waits: embedded with `--disable-overlap-schedule`, each decode step waiting for its draws;
- embedded_pair: embedded and embedded_batch on one server, a pass of each in turn (their order swapped from
  pass to pass), each pass's answer a pair: the ratio of the two is not at the mercy of the load's drift;
- generate: transformers `model.generate` on one left-padded batch of every prompt, do_sample at
  temperature 1 with no top-k / top-p, num_return_sequences n, min_new_tokens = max_new_tokens (EOS
  never ends a row, as ignore_eos); no logprobs (keeping the scores would keep every step's logits);
- generate_batch: transformers continuous batching (`model.generate_batch`, what TRL's GRPO trainer
  calls), the same sampling, eos_token_id -1 (no EOS), return_logprobs, its KV cache sized for the
  case (`cache_size`); each timed call builds its own manager (cache, CUDA graphs), as a call per
  GRPO step does;
- copy: no model; the device-to-device copy bandwidth the benchmark's roofline divides by.
Every engine first runs the case's batch for WARM_UP_TOKENS tokens (warm-up, untimed); the embedded
engine's first shape runs the case's whole length (at most WHOLE_WARM_UP_MAX tokens) once more, untimed:
its decode graphs are captured per block-table width, and a batch that grows past a width captures the
next one in the pass that gets there first (on the H200, 1.4 s of a 3.9 s pass of 64 x 8 x 256, and the
per-request / batched ratio read 0.85 where the warm passes gave 0.95-0.99). transformers' engines run
the whole length once more too (untimed: on an H100 at 0567b87 `generate`'s first full pass of 64 x 8 x
256 took 14.5 s, its second 5.6 s). The answer (JSON at --out): each timed pass's seconds, tokens, rows.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shlex
import signal
import sys
import time
from pathlib import Path

import torch

from rollfleet.sample import output_logprobs

SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # transformers: sampling from the whole distribution


WARM_UP_TOKENS = 8
# the embedded engine's whole-length warm-up stops here: 16 x 8 x 8192's would take as long as its timed
# pass (an H100 call at 8327bf3 ran out of its 200 s case limit in the two)
WHOLE_WARM_UP_MAX = 2048


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- embedded engine over HTTP ----------------------------------------------------------------------
def run_embedded(args, prompts: list[list[int]], shapes: tuple[bool, ...] = (False,), more=()) -> list[dict]:
    """The engine server driven as a GRPO step drives it: one /generate per prompt with n, all at
    once; `shapes` (False: per request, True: ONE /generate of every prompt, the per-request path's
    reference: the same tokens without 64 requests' parsing, admission and answers). With both, each
    pass runs both shapes on the one server, their order swapped from pass to pass, so that the
    machine's drift (other load, clocks) falls on both alike; a pass's answer is a list per shape.
    `more`: the server's further flags."""
    from rollfleet.engine.process.launch import EngineProcess, embedded_argv
    from rollfleet.engine.process.zygote_client import Zygote
    from rollfleet.wire.net import free_port

    port, log = free_port(), Path(args.out).with_suffix(".engine.log")
    flags = ["--device", args.device, "--dtype", args.dtype, *more, *shlex.split(args.engine_flags)]
    samples = len(prompts) * args.n  # one batch; a batched request asks for all of them at once
    flags += ["--max-running-requests", str(samples), "--max-samples-per-request", str(samples)]
    engine = EngineProcess(
        embedded_argv(args.model, port, extra=flags), port=port, log_path=log, zygote=Zygote.shared(log)
    )
    try:
        engine.wait_until_up(timeout=args.start_timeout_s)
        return asyncio.run(_embedded_passes(engine.url, prompts, args, shapes))
    finally:
        engine.stop()


def run_embedded_waits(args, prompts: list[list[int]]) -> list[dict]:
    """embedded with its decode steps waiting for their draws (no overlap: kv/overlap.py)."""
    return run_embedded(args, prompts, more=("--disable-overlap-schedule",))


def run_embedded_batch(args, prompts: list[list[int]]) -> list[dict]:
    return run_embedded(args, prompts, (True,))


def run_embedded_pair(args, prompts: list[list[int]]) -> list[dict]:
    """embedded and embedded_batch on one server, pass by pass (what `rollfleet bench generate` runs
    when both are asked for)."""
    return run_embedded(args, prompts, (False, True))


async def _embedded_passes(url: str, prompts: list[list[int]], args, shapes: tuple[bool, ...]) -> list:
    from rollfleet.wire.client import EngineClient

    def params(n: int, new_tokens: int) -> dict:
        # SGLang's defaults are top_k -1 and top_p 1 (no filter)
        return {"n": n, "max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}

    asked = {"return_logprob": True, "return_logprob_values": True if args.logprob_values else None}

    async def outputs(client, new_tokens: int, batched: bool) -> list[dict]:
        if batched:
            answer = await client.generate(input_ids=prompts, sampling_params=params(args.n, new_tokens), **asked)
            return answer if isinstance(answer, list) else [answer]
        answers = await asyncio.gather(
            *(client.generate(input_ids=p, sampling_params=params(args.n, new_tokens), **asked) for p in prompts)
        )
        return [o for a in answers for o in (a if isinstance(a, list) else [a])]

    async def one_pass(client, batched: bool) -> dict:
        await client.flush_cache()  # each pass prefills its prompts (no pages cached by the last one)
        before = (await client.get_server_info())["scheduler_stats"]
        begin_at = time.monotonic()  # the engine's clock's (one reading: two clocks read apart skew the split)
        outs = await outputs(client, args.new_tokens, batched)
        end_at = time.monotonic()
        seconds = end_at - begin_at
        logprobs = sum(len(output_logprobs(o["meta_info"])) for o in outs)
        tokens = sum(len(o["output_ids"]) for o in outs)
        info = await client.get_server_info()
        after = info["scheduler_stats"]
        engine = {
            key: after[key] - before[key]
            for key in ("batches", "joined", "recomputed_prefixes", "host_bytes", "prefill_tokens", "preempted")
            + ("prefill_steps", "decode_steps", "prefill_seconds", "decode_seconds")
            + ("device_wait_seconds", "device_waits", "arrival_holds", "arrival_hold_seconds", "texts_ahead_pieces")
            if key in after
        }
        if engine.get("batches") == 1 and "answered_at" in after:
            engine["clock"] = outside_split(after, engine, begin_at, end_at)
        graphs = (info.get("rollfleet_kv_cache") or {}).get("cuda_graphs")
        if graphs:  # captured so far (a capture inside a pass is part of its time)
            engine["graph_captures"], engine["graph_capture_s"] = graphs["captures"], graphs["capture_s"]
        prefill = (info.get("rollfleet_kv_cache") or {}).get("prefill_graphs")
        if prefill:  # small prefills' graphs (kv/prefill_graphs.py), so far: replays say a pass's prefill used one
            engine["prefill_graph_captures"], engine["prefill_graph_replays"] = prefill["captures"], prefill["replays"]
        return {"seconds": seconds, "tokens": tokens, "rows": len(outs), "logprobs": logprobs, "scheduler": engine}

    async with EngineClient(url, timeout=args.timeout_s) as client:
        for batched in shapes:  # warm-up: the case's batch, a few tokens (first-use costs of its shapes)
            await outputs(client, WARM_UP_TOKENS, batched)
        # and its whole length (every graph width captured), up to WHOLE_WARM_UP_MAX tokens: a longer
        # case's wider graphs are captured in its first timed pass (tens of ms in a pass of minutes)
        await outputs(client, min(args.new_tokens, WHOLE_WARM_UP_MAX), shapes[0])
        gc.collect(), gc.freeze()  # the client out of the collector's scans, as the GRPO driver (train/loop.py)
        passes = []
        for index in range(args.repeats):
            order = shapes if index % 2 == 0 else shapes[::-1]
            done = {batched: await one_pass(client, batched) for batched in order}
            passes.append([done[batched] for batched in shapes] if len(shapes) > 1 else done[shapes[0]])
        return passes


def outside_split(clock: dict, steps: dict, begin_at: float, end_at: float) -> dict[str, float]:
    """A one-batch pass's time outside its steps, by the engine's clock (time.monotonic, one clock for
    the host's processes): before its first step (the requests sent, read, queued, the arrival hold),
    between its steps (the engine thread's own work: admission, retiring, locks), answering (the last
    step's finished requests retired, their texts decoded, their answers built, on the engine thread)
    and delivery (the server's event loop woken, the answers written and sent, the client's reading
    of them)."""
    span = clock["steps_ended_at"] - clock["batch_began_at"]
    return {
        "before_steps_s": clock["batch_began_at"] - begin_at,
        "between_steps_s": span - steps["prefill_seconds"] - steps["decode_seconds"],
        "answering_s": clock["answered_at"] - clock["steps_ended_at"],
        "of_which_retire_s": clock["retired_at"] - clock["steps_ended_at"],
        "of_which_texts_s": clock["decoded_at"] - clock["retired_at"],
        "delivery_s": end_at - clock["answered_at"],
    }


# ---- transformers -------------------------------------------------------------------------------------
def _load(args):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    return model.to(args.device).eval()


def _left_padded(prompts: list[list[int]], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def run_generate(args, prompts: list[list[int]]) -> list[dict]:
    from transformers import GenerationConfig

    model = _load(args)

    def config(n: int, new_tokens: int) -> GenerationConfig:
        return GenerationConfig(
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=n,
            eos_token_id=0,
            pad_token_id=0,
            **SAMPLING,
        )

    def one_pass(batch: list[list[int]], n: int, new_tokens: int) -> dict:
        ids, mask = _left_padded(batch, 0, args.device)
        _sync(args.device)
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(n, new_tokens))
        _sync(args.device)
        seconds = time.perf_counter() - begin
        return {"seconds": seconds, "tokens": out.shape[0] * (out.shape[1] - ids.shape[1]), "rows": out.shape[0]}

    one_pass(prompts, args.n, WARM_UP_TOKENS)  # warm-up: the case's batch, a few tokens
    one_pass(prompts, args.n, args.new_tokens)  # and its whole length, as the embedded engine's warm-up
    return [one_pass(prompts, args.n, args.new_tokens) for _ in range(args.repeats)]


def cache_size(batch: list[list[int]], n: int, new_tokens: int, page_size: int = 256) -> dict[str, int]:
    """generate_batch's KV cache sized for the case: a page per `page_size` tokens of every row's prompt
    and new tokens, and room to prefill every prompt in one batch (left unset, both are sized from the
    device's free memory: on CPU that took 10-25 s per call for 4 rows of 8 tokens)."""
    rows, longest = len(batch) * n, max(len(p) for p in batch) + new_tokens
    pages = rows * -(-longest // page_size) + 16
    return {"page_size": page_size, "num_blocks": pages, "max_batch_tokens": max(rows, sum(len(p) for p in batch))}


def run_generate_batch(args, prompts: list[list[int]]) -> list[dict]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _load(args)

    def one_pass(batch: list[list[int]], n: int, new_tokens: int) -> dict:
        config = GenerationConfig(
            do_sample=True,
            max_new_tokens=new_tokens,
            num_return_sequences=n,
            eos_token_id=-1,
            pad_token_id=0,
            **SAMPLING,
        )
        _sync(args.device)
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model.generate_batch(
                inputs=batch,
                generation_config=config,
                continuous_batching_config=ContinuousBatchingConfig(
                    return_logprobs=True, **cache_size(batch, n, new_tokens)
                ),
                progress_bar=False,
            )
        _sync(args.device)
        seconds = time.perf_counter() - begin
        failed = [o.error for o in out.values() if o.error is not None]
        assert not failed, f"generate_batch: {len(failed)} requests failed, the first: {failed[0]}"
        tokens = sum(len(o.generated_tokens) for o in out.values())
        logprobs = sum(len(o.logprobs or []) for o in out.values())
        return {"seconds": seconds, "tokens": tokens, "rows": len(out), "logprobs": logprobs}

    one_pass(prompts, args.n, WARM_UP_TOKENS)  # warm-up: the case's batch, a few tokens
    one_pass(prompts, args.n, args.new_tokens)  # and its whole length, as the embedded engine's warm-up
    return [one_pass(prompts, args.n, args.new_tokens) for _ in range(args.repeats)]


# ---- the roofline's bandwidth ---------------------------------------------------------------------------
def run_copy(args, prompts: list[list[int]]) -> list[dict]:
    """`repeats` timed copies of a large buffer (CUDA events on a GPU); a copy reads and writes its
    bytes, so each pass moves twice the buffer's size."""
    nbytes = int(args.copy_gb * 1e9)
    source = torch.ones(nbytes, dtype=torch.uint8, device=args.device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    passes = []
    for _ in range(args.repeats):
        if args.device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - start
        passes.append({"seconds": seconds, "bytes_moved": 2 * nbytes, "gb_per_s": 2 * nbytes / seconds / 1e9})
    return passes


ENGINES = {
    "embedded": run_embedded,
    "embedded_batch": run_embedded_batch,
    "embedded_waits": run_embedded_waits,
    "embedded_pair": run_embedded_pair,
    "generate": run_generate,
    "generate_batch": run_generate_batch,
    "copy": run_copy,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollfleet.bench.generate_engines")
    p.add_argument("engine", choices=sorted(ENGINES))
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=None, help="a JSON list of prompts, each a list of token ids")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--copy-gb", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=600, help="one HTTP answer (embedded)")
    p.add_argument("--start-timeout-s", type=float, default=600, help="the engine server's start (embedded)")
    p.add_argument("--out", required=True)
    p.add_argument("--logprob-values", action="store_true", help="embedded: return_logprob_values (one list a sample)")
    p.add_argument("--engine-flags", default="", help="embedded: the server's further flags, one string")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # the benchmark stops an engine that runs too long with SIGTERM: end through `finally` (an embedded
    # engine's server is stopped with it)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else []
    began = time.perf_counter()
    passes = ENGINES[args.engine](args, prompts)
    answer = {"engine": args.engine, "passes": passes, "process_s": time.perf_counter() - began}
    Path(args.out).write_text(json.dumps(answer))


if __name__ == "__main__":
    main()
