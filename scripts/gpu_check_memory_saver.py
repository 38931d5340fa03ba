"""GPU check of the colocated turn's engine side with torch_memory_saver (one GPU; the saver
installed, e.g. `pip install --target DIR torch_memory_saver==0.0.10` with DIR on PYTHONPATH).

    python scripts/gpu_check_memory_saver.py

A Qwen3-shaped bf16 model (hidden 1024, 8 layers) served by the embedded engine with the pool sized
from memory (tens of GiB). A greedy batch; release kv_cache + cuda_graph, resume: the same tokens,
no graph captured again, the pool's memory returned while released; then cuda_graph alone released
(decode runs eagerly, same tokens); then every tag with the weights' host copy: the same tokens again.
Prints one JSON line per check (also to $OUT/memory_saver_check.json when OUT is set); exits non-zero
on the first failed assertion.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")

from rollfleet.engine.process.launch import EngineProcess, embedded_argv  # noqa: E402
from rollfleet.tiny_models import make_tiny_model  # noqa: E402
from rollfleet.wire.client import EngineClient, EngineError  # noqa: E402
from rollfleet.wire.net import free_port  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16)
SHAPE.update(num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
PROMPTS = [[3 + i, *range(20 + i, 30 + i + 3 * (i % 5))] for i in range(32)]
REPORT: list[dict] = []


def say(**line) -> None:
    REPORT.append(line)
    print(json.dumps(line), flush=True)


async def greedy(client: EngineClient) -> list[list[int]]:
    """One request of every prompt: they join one batch together each time, so bf16 arithmetic (which
    depends on the batch's composition) is the same from run to run, and equal tokens mean equal KV."""
    answers = await client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [a["output_ids"] for a in answers]


def differing(got: list[list[int]], want: list[list[int]]) -> int:
    return sum(a != b for a, b in zip(got, want))


async def timed(call, tags) -> float:
    start = time.perf_counter()
    await call(tags)
    return time.perf_counter() - start


async def kv_and_graphs(client: EngineClient) -> dict:
    info = await client.get_server_info()
    return info["rollfleet_kv_cache"]


async def check(url: str) -> None:
    async with EngineClient(url, timeout=600) as engine:
        kv = await kv_and_graphs(engine)
        say(check="start", kv=kv)
        assert kv["memory_saver"] is True, "the saver is not in use: see the engine's log for why"
        want = await greedy(engine)
        control = await greedy(engine)  # no release between: what a rerun alone gives
        say(check="a rerun without a release", differing_rows=differing(control, want))
        assert control == want, "greedy tokens differ between two runs with no release: the check cannot tell"
        captures = (await kv_and_graphs(engine))["cuda_graphs"]["captures"]
        assert captures > 0, "no decode graph was captured"
        for turn in range(3):  # a colocated turn that keeps its weights, thrice
            held = (await engine.memory())[0]["device_used"]
            released = await timed(engine.release_memory_occupation, ["kv_cache", "cuda_graph"])
            freed = held - (await engine.memory())[0]["device_used"]
            resumed = await timed(engine.resume_memory_occupation, ["cuda_graph", "kv_cache"])
            got, kv = await greedy(engine), await kv_and_graphs(engine)
            new_captures = kv["cuda_graphs"]["captures"] - captures
            say(check=f"turn {turn}: release kv_cache+cuda_graph, resume", release_s=round(released, 4),
                resume_s=round(resumed, 4), freed_gib=round(freed / 2**30, 2), differing_rows=differing(got, want),
                new_captures=new_captures, target_met=released + resumed <= 0.05)  # fmt: skip
            assert got == want, "tokens changed after a release and resume of kv_cache + cuda_graph"
            assert new_captures == 0, "graphs were captured again after the resume"
            assert freed > 0.9 * kv["pages"] * kv["page_size"] * BYTES_PER_TOKEN, "the pool's memory stayed mapped"
        await refused_resume_keeps_serving(engine, want)
        await engine.release_memory_occupation(["cuda_graph"])  # graphs paused, KV held: decode runs eagerly
        got, kv = await greedy(engine), await kv_and_graphs(engine)
        await engine.resume_memory_occupation(["cuda_graph"])
        say(
            check="cuda_graph alone released: eager decode",
            differing_rows=differing(got, want),
            graphs=kv["cuda_graphs"],
        )
        assert got == want and kv["cuda_graphs"]["captures"] == captures
        released = await timed(engine.release_memory_occupation, None)  # weights too, with their host copy
        resumed = await timed(engine.resume_memory_occupation, ["weights", "cuda_graph", "kv_cache"])
        got, kv = await greedy(engine), await kv_and_graphs(engine)
        say(check="every tag released and resumed (weights from the host copy)", release_s=round(released, 4),
            resume_s=round(resumed, 4), differing_rows=differing(got, want), graphs=kv["cuda_graphs"])  # fmt: skip
        assert got == want, "tokens changed after the weights came back from their host copy"


async def refused_resume_keeps_serving(engine: EngineClient, want: list[list[int]]) -> None:
    """Another process takes the released pool's memory (as a trainer that kept its memory does): the
    resume is a 400 naming the figures, the server stays up, and once the memory is back it resumes."""
    import torch

    await engine.release_memory_occupation(["kv_cache", "cuda_graph"])
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (512 << 20), dtype=torch.uint8, device="cuda")  # leaves 0.5 GiB free
    try:
        await engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
        refusal = None
    except EngineError as exc:
        refusal = exc
    alive = (await engine.get_server_info()) is not None
    del hog
    torch.cuda.empty_cache()
    await engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    got = await greedy(engine)
    say(check="a resume the device cannot back: refused, then resumed", status=getattr(refusal, "status_code", None),
        message=str(refusal)[:300], alive=alive, differing_rows=differing(got, want))  # fmt: skip
    assert refusal is not None and refusal.status_code == 400 and "refused, nothing changed" in str(refusal)
    assert got == want, "tokens changed after a refused resume and a resume"


BYTES_PER_TOKEN = SHAPE["num_hidden_layers"] * 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2  # bf16


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="rf-saver-check-"))
    model = str(make_tiny_model(scratch / "model", seed=1, **SHAPE))
    port = free_port()
    flags = ["--device", "cuda", "--dtype", "bfloat16", "--enable-weights-cpu-backup"]
    proc = EngineProcess(embedded_argv(model, port, extra=flags), port=port, log_path=scratch / "engine.log")
    try:
        proc.wait_until_up(timeout=300)
        asyncio.run(check(proc.url))
    finally:
        proc.stop()
        print((scratch / "engine.log").read_text()[-3000:], flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "memory_saver_check.json").write_text(json.dumps(REPORT, indent=1))


if __name__ == "__main__":
    main()
