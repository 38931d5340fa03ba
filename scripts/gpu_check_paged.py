"""GPU check of the paged KV path (issue: generation on GPU, step 2), one H200.

    python scripts/gpu_check_paged.py

A tiny Qwen3 in float32 on the GPU, served twice: the paged pool with CUDA graphs and the dense
cache. The same greedy batch (prompts x n, with a request joining mid-run) on both, token by token;
then release kv_cache + weights + cuda_graph, resume, reload, and the same batch again (graphs
recaptured on the new addresses); then an in-place weight update changes the outputs. Prints one
JSON line per check (and writes them to $OUT/paged_check.json when OUT is set).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")

from rollfleet.engine.process.launch import EngineProcess, embedded_argv  # noqa: E402
from rollfleet.tiny_models import make_tiny_model  # noqa: E402
from rollfleet.wire.client import EngineClient  # noqa: E402
from rollfleet.wire.net import free_port  # noqa: E402

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, "n": 4}
PROMPTS = [[3 + i, *range(20 + i, 20 + i + 5 + 3 * (i % 7))] for i in range(24)]
REPORT: list[dict] = []


def say(**line) -> None:
    REPORT.append(line)
    print(json.dumps(line), flush=True)


async def greedy(client: EngineClient) -> list[list[int]]:
    first = asyncio.gather(*(client.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS[:16]))
    await asyncio.sleep(0.05)  # the rest arrive while the first run: they join the running set
    late = await asyncio.gather(*(client.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS[16:]))
    answers = [*await first, *late]
    return [o["output_ids"] for a in answers for o in a]


async def check(paged_url: str, dense_url: str, model_a: str, model_b: str) -> None:
    async with EngineClient(paged_url, timeout=300) as paged, EngineClient(dense_url, timeout=300) as dense:
        want, got = await greedy(dense), await greedy(paged)
        same = sum(a == b for a, b in zip(want, got))
        info = await paged.get_server_info()
        say(check="paged+graphs vs dense, greedy", equal_rows=same, rows=len(want), kv=info["rollfleet_kv_cache"])
        say(check="scheduler", stats=info["scheduler_stats"])
        await paged.release_memory_occupation(["kv_cache", "weights", "cuda_graph"])
        await paged.resume_memory_occupation(["kv_cache", "weights", "cuda_graph"])
        await paged.update_weights_from_disk(model_a)
        again = await greedy(paged)
        info = await paged.get_server_info()
        equal = sum(a == b for a, b in zip(want, again))
        say(check="after release+resume+reload", equal_rows=equal, kv=info["rollfleet_kv_cache"])
        await paged.update_weights_from_disk(model_b)
        other = await greedy(paged)
        await dense.update_weights_from_disk(model_b)
        other_dense = await greedy(dense)
        say(
            check="in-place update changes outputs",
            changed_rows=sum(a != b for a, b in zip(want, other)),
            equal_to_dense_b=sum(a == b for a, b in zip(other, other_dense)),
        )


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="rf-paged-check-"))
    model_a = str(make_tiny_model(scratch / "a", seed=1, hidden_size=256, num_hidden_layers=4, head_dim=64))
    model_b = str(make_tiny_model(scratch / "b", seed=2, hidden_size=256, num_hidden_layers=4, head_dim=64))
    procs = {}
    for layout in ("paged", "dense"):
        port = free_port()
        flags = ["--device", os.environ.get("DEVICE", "cuda"), "--dtype", "float32", "--rollfleet-kv-cache", layout]
        flags += ["--max-total-tokens", "65536"]
        argv = embedded_argv(model_a, port, extra=flags)
        procs[layout] = EngineProcess(argv, port=port, log_path=scratch / f"{layout}.log")
    try:
        for proc in procs.values():
            proc.wait_until_up(timeout=300)
        asyncio.run(check(procs["paged"].url, procs["dense"].url, model_a, model_b))
    finally:
        for proc in procs.values():
            proc.stop()
        print((scratch / "paged.log").read_text()[-3000:], flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "paged_check.json").write_text(json.dumps(REPORT, indent=1))


if __name__ == "__main__":
    main()
