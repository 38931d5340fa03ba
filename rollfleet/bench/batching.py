"""Tokens per second of one embedded engine: N requests sent one by one vs all at once.

    rollfleet bench batching [--requests 32] [--max-new-tokens 64] [--model-path DIR]

Without --model-path it builds the tiny test model (hidden 64, 2 layers) in a temp directory.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from rollfleet.engine.launch import EngineProcess, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


async def _measure(url: str, requests: int, max_new_tokens: int) -> tuple[float, float]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
    prompts = [[1 + i % 50, 2, 3, 4] for i in range(requests)]
    async with EngineClient(url) as client:
        await client.generate(input_ids=prompts[0], sampling_params=params)  # warm-up
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
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model_path or str(make_tiny_model(Path(scratch) / "model"))
        port = free_port()
        engine = EngineProcess(embedded_argv(model_path, port), port=port, log_path=Path(scratch) / "engine.log")
        try:
            engine.wait_until_up(timeout=120)
            sequential, batched = asyncio.run(_measure(engine.url, args.requests, args.max_new_tokens))
        finally:
            engine.stop()
    print(f"{args.requests} requests x {args.max_new_tokens} new tokens, one embedded engine (CPU, tp=1)")
    print(f"  one by one   : {sequential:10.1f} tokens/s")
    print(f"  all at once  : {batched:10.1f} tokens/s")
    print(f"  speed-up     : {batched / sequential:10.2f}x  (target >= 5x)")


if __name__ == "__main__":
    main()
