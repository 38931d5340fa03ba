"""Tokens per second of one embedded engine: N requests sent one by one vs all at once.

    rollfleet bench batching [--requests 32] [--max-new-tokens 64] [--repeats 3] [--model-path DIR] [--json F]

Without --model-path it builds the tiny test model (hidden 64, 2 layers) in a temp directory.
Both modes are measured `--repeats` times on one engine after one warm-up request; the speed-up is
the ratio of the median tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rollfleet.bench.record import command_line, make_record, spread, start, write_record
from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


async def _measure(url: str, requests: int, max_new_tokens: int, repeats: int) -> list[tuple[float, float]]:
    async with EngineClient(url) as client:
        params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
        await client.generate(input_ids=[1, 2, 3, 4], sampling_params=params)  # warm-up
        return [await _one_pass(client, requests, max_new_tokens) for _ in range(repeats)]


async def _one_pass(client: EngineClient, requests: int, max_new_tokens: int) -> tuple[float, float]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    prompts = [[1 + i % 50, 2, 3, 4] for i in range(requests)]
    start = time.perf_counter()
    sequential = [await client.generate(input_ids=p, sampling_params=params) for p in prompts]
    one_by_one = time.perf_counter() - start
    start = time.perf_counter()
    together = await asyncio.gather(*(client.generate(input_ids=p, sampling_params=params) for p in prompts))
    all_at_once = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in sequential)
    assert tokens == sum(len(o["output_ids"]) for o in together) == requests * max_new_tokens
    return tokens / one_by_one, tokens / all_at_once


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollfleet bench batching")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--json", default=None, help="write the record (rollfleet/bench/record.py) to this file")
    args = parser.parse_args(argv)
    command, started = command_line(["rollfleet", "bench", "batching"], argv), start()
    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model_path or str(make_tiny_model(Path(scratch) / "model"))
        port = free_port()
        engine = EngineProcess(embedded_argv(model_path, port), port=port, log_path=Path(scratch) / "engine.log")
        try:
            engine.wait_until_up(timeout=120)
            passes = asyncio.run(_measure(engine.url, args.requests, args.max_new_tokens, args.repeats))
        finally:
            engine.stop()
    rows = [{"repeat": i + 1, "one_by_one_tok_s": s, "all_at_once_tok_s": b} for i, (s, b) in enumerate(passes)]
    sequential = statistics.median(r["one_by_one_tok_s"] for r in rows)
    batched = statistics.median(r["all_at_once_tok_s"] for r in rows)
    summary = {
        "one_by_one_tok_s": spread([r["one_by_one_tok_s"] for r in rows]),
        "all_at_once_tok_s": spread([r["all_at_once_tok_s"] for r in rows]),
        "speed_up": batched / sequential,
    }
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens, one embedded engine (CPU, tp=1), "
        f"median of {args.repeats}"
    )
    print(f"  one by one   : {sequential:10.1f} tokens/s")
    print(f"  all at once  : {batched:10.1f} tokens/s")
    print(f"  speed-up     : {batched / sequential:10.2f}x  (target >= 5x)")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "model_path")}
    config["model"] = "given" if args.model_path else "tiny test model (hidden 64, 2 layers)"
    write_record(args.json, make_record("batching", command, config, rows, summary, True, started=started))


if __name__ == "__main__":
    main()
