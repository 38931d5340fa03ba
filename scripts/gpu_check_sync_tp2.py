"""GPU check of weight sync into a tp=2 engine on two GPUs (docs/benchmarks.md):

1. `tensor` (CUDA IPC) from a model on GPU 0 into an embedded engine with tp=2 on GPUs 0 and 1:
   rank 1 opens handles to GPU 0's memory. Verified by fingerprint; greedy tokens equal a plain
   transformers forward pass of the sent weights.
2. A bad update (one tensor of the wrong shape, in a late call) is refused and changes nothing.
3. `lora` (from tensors on GPU 0): generation with the adapter equals peft's merge_and_unload.

    python scripts/gpu_check_sync_tp2.py [--log-dir DIR] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from rollfleet.config import LoraSync, TensorSync
from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.client import EngineClient
from rollfleet.wire.errors import EngineError
from rollfleet.wire.net import free_port

PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7, 9]]
NEW_TOKENS = 12


def greedy_reference(model) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(NEW_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            ids.append(int(logits.argmax()))
        out.append(ids[len(prompt) :])
    return out


async def engine_state(url: str, lora_path: str | None = None):
    async with EngineClient(url, timeout=120) as client:
        outs = await client.generate(
            input_ids=PROMPTS,
            lora_path=lora_path,
            sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        return [o["output_ids"] for o in outs], await client.weights_fingerprint(None)


async def verify(url: str, report) -> dict:
    async with EngineClient(url, timeout=120) as client:
        return await find_unverified(report, {0: client})


def send(spec, source, version: str, url: str):
    transport = make_transport(
        spec, [EngineTarget(engine_id=0, url=url, num_ranks=2, rank_offset=1, dtype=torch.float32)], timeout_s=120
    )
    try:
        return transport.send(source, version)
    finally:
        transport.disconnect()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    sender = "cuda:0" if args.device == "cuda" else "cpu"
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        shape = dict(
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
        )
        make_tiny_model(str(scratch / "a"), seed=1, **shape)
        make_tiny_model(str(scratch / "b"), seed=2, **shape)
        port = free_port()
        engine = EngineProcess(
            embedded_argv(
                str(scratch / "a"),
                port,
                tp_size=2,
                extra=["--device", args.device, "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8"],
            ),
            port=port,
            log_path=Path(args.log_dir or scratch) / "engine-tp2.log",
        )
        try:
            engine.wait_until_up(timeout=300)
            trainer = AutoModelForCausalLM.from_pretrained(scratch / "b", dtype=torch.float32).to(sender).eval()
            want = greedy_reference(trainer)

            # 1. tensor over CUDA IPC into tp=2 (rank 1 on the other GPU); small buckets: several calls
            report = send(TensorSync(bucket_mb=4), ModuleSource(trainer), "b", engine.url)
            problems = asyncio.run(verify(engine.url, report))
            tokens, prints_b = asyncio.run(engine_state(engine.url))
            results["tensor tp=2: verified"] = problems == {}
            results["tensor tp=2: greedy tokens equal transformers (fp32)"] = tokens == want
            print(
                f"tensor sync: {report.bytes / 1e6:.1f} MB in {report.buckets} buckets, {report.seconds * 1e3:.1f} ms; "
                f"problems {problems}",
                flush=True,
            )

            # 2. a late tensor of the wrong shape: that call is refused naming the tensor; the session
            #    ends incomplete, so the engine serves nothing (503) until a complete sync commits
            bad = copy.deepcopy(trainer)
            last = dict(bad.named_parameters())["model.norm.weight"]
            last.data = torch.ones(last.shape[0] + 1, device=last.device)
            try:
                send(TensorSync(bucket_mb=4), ModuleSource(bad), "bad", engine.url)
                refused = False
            except Exception as exc:  # noqa: BLE001
                refused = "model.norm.weight" in str(exc)
                print(f"bad update refused: {str(exc)[:200]}", flush=True)
            try:
                asyncio.run(engine_state(engine.url))
                held = False
            except EngineError as exc:
                held = exc.status_code == 503 and "mixed" in str(exc)
            results["bad update refused naming the tensor"] = refused
            results["bad update: engine serves nothing until a complete sync"] = held
            report = send(TensorSync(bucket_mb=4), ModuleSource(trainer), "b2", engine.url)
            tokens_after, prints_after = asyncio.run(engine_state(engine.url))
            results["complete re-sync: same weights and tokens as before"] = (
                prints_after == prints_b and tokens_after == want
            )

            # 3. lora from tensors on GPU 0
            torch.manual_seed(3)
            peft_model = get_peft_model(
                copy.deepcopy(trainer),
                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
            )
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0, 0.05)
            merged = copy.deepcopy(peft_model).merge_and_unload().eval()
            want_lora = greedy_reference(merged)
            report = send(LoraSync(), LoraSource(peft_model), "lora-1", engine.url)
            problems = asyncio.run(verify(engine.url, report))
            tokens_lora, _ = asyncio.run(engine_state(engine.url, lora_path=report.lora_name))
            tokens_base, _ = asyncio.run(engine_state(engine.url))
            results["lora tp=2: verified"] = problems == {}
            results["lora tp=2: tokens equal peft merge_and_unload"] = tokens_lora == want_lora
            results["lora tp=2: differs from base; base unchanged"] = want_lora != want and tokens_base == want
        finally:
            engine.stop()
    for check, ok in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
