"""`make demo`: one embedded engine on a tiny model built in code, a batch of requests, the results.

This is the engine-only demo; the GRPO run replaces it once the training loop lands.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollfleet.engine.client import EngineClient
from rollfleet.engine.launch import EngineProcess, embedded_argv, free_port
from rollfleet.tiny import make_tiny_model

PROMPTS = ["what is 12 plus 7?", "the quick brown fox", "reinforcement learning", "0 1 2 3"]


async def _ask(url: str) -> tuple[list[dict], float]:
    async with EngineClient(url) as client:
        start = time.perf_counter()
        outs = await client.generate(text=PROMPTS, return_logprob=True,
                                     sampling_params={"max_new_tokens": 24, "temperature": 0.8, "n": 2})
        return outs, time.perf_counter() - start


def main() -> None:
    console = Console()
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "tiny-qwen3")
        port = free_port()
        engine = EngineProcess(embedded_argv(str(model), port), port=port, log_path=Path(scratch) / "engine.log")
        console.print(f"starting an embedded engine on {engine.url} (tiny Qwen3, CPU) ...")
        try:
            engine.wait_until_up(timeout=120)
            outs, seconds = asyncio.run(_ask(engine.url))
        finally:
            engine.stop()
    table = Table(title=f"{len(outs)} samples ({len(PROMPTS)} prompts x n=2) in {seconds:.2f} s")
    for column in ("prompt", "output (random tiny model)", "tokens", "finish", "mean logprob", "version"):
        table.add_column(column)
    for index, out in enumerate(outs):
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
        table.add_row(PROMPTS[index // 2], repr(out["text"][:40]), str(len(out["output_ids"])),
                      meta["finish_reason"]["type"], f"{sum(logprobs) / max(len(logprobs), 1):.2f}",
                      meta["weight_version"])
    console.print(table)


if __name__ == "__main__":
    main()
