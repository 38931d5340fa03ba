"""GPU check of the embedded engine (issue: engine): tp=2 across two GPUs serves generate, reloads
from disk, releases and resumes memory. Prints one JSON report (and writes it to $OUT if set).

    python scripts/gpu_check_engine.py [--hidden 2048 --layers 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.tiny_models import make_tokenizer, tiny_config
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port


def write_model(directory: Path, seed: int, hidden: int, layers: int) -> None:
    tokenizer = make_tokenizer()
    config = tiny_config(
        "qwen3",
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=4 * hidden,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(2, hidden // 512),
        head_dim=128,
    )
    torch.manual_seed(seed)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id).save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def reference_tokens(directory: Path, prompts, max_new_tokens: int, dtype=torch.bfloat16) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to("cuda:0").eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids], device="cuda:0")).logits[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    del model
    torch.cuda.empty_cache()
    return outs


async def exercise(url: str, dir_a: Path, dir_b: Path, prompts, report: dict) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    async with EngineClient(url, timeout=600) as client:
        report["server_info"] = {
            k: v
            for k, v in (await client.get_server_info()).items()
            if k in ("tp_size", "device", "base_gpu_id", "dtype")
        }
        outs = await client.generate(input_ids=prompts, sampling_params=greedy)
        report["generate_a"] = [o["output_ids"] for o in outs]
        start = time.perf_counter()
        await client.update_weights_from_disk(str(dir_b), weight_version="b")
        report["reload_seconds"] = round(time.perf_counter() - start, 3)
        outs = await client.generate(input_ids=prompts, sampling_params=greedy)
        report["generate_b"] = [o["output_ids"] for o in outs]
        report["version_after_reload"] = outs[0]["meta_info"]["weight_version"]
        await client.release_memory_occupation(None)  # SGLang's null body: the figures come from /rollfleet/memory
        report["release"] = await client.memory()
        report["health_generate_after_release"] = await client.health_generate()
        await client.resume_memory_occupation(None)
        report["resume"] = await client.memory()
        await client.update_weights_from_disk(str(dir_b), weight_version="b2")
        outs = await client.generate(input_ids=prompts, sampling_params=greedy)
        report["generate_b_after_resume_equal"] = [o["output_ids"] for o in outs] == report["generate_b"]


async def fp32_tokens(url: str, prompts) -> list[list[int]]:
    async with EngineClient(url, timeout=600) as client:
        outs = await client.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
        )
        return [o["output_ids"] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    report: dict = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    prompts = [[5, 17, 42, 99, 7], [3, 4], [100, 200, 300]]
    with tempfile.TemporaryDirectory() as scratch:
        dir_a, dir_b = Path(scratch) / "a", Path(scratch) / "b"
        write_model(dir_a, 0, args.hidden, args.layers)
        write_model(dir_b, 1, args.hidden, args.layers)
        report["checkpoint_gb"] = round(sum(f.stat().st_size for f in dir_a.glob("*.safetensors")) / 1e9, 2)
        report["reference_a"] = reference_tokens(dir_a, prompts, 16)
        report["reference_b"] = reference_tokens(dir_b, prompts, 16)
        report["reference_fp32"] = reference_tokens(dir_a, prompts, 16, torch.float32)
        port = free_port()
        log = Path(os.environ.get("OUT", scratch)) / "engine-tp2.log"
        engine = EngineProcess(
            embedded_argv(str(dir_a), port, tp_size=2, extra=["--device", "cuda"]), port=port, log_path=log
        )
        try:
            start = time.perf_counter()
            engine.wait_until_up(timeout=300)
            report["startup_seconds"] = round(time.perf_counter() - start, 1)
            asyncio.run(exercise(engine.url, dir_a, dir_b, prompts, report))
        finally:
            engine.stop()
        # bf16 TP and one-GPU bf16 round differently and random weights give near-flat logits, so
        # tokens are compared exactly in fp32, on an engine placed by --base-gpu-id on GPU 1 alone too
        for tp_size, base in ((2, 0), (1, 1)):
            port = free_port()
            engine = EngineProcess(
                embedded_argv(
                    str(dir_a),
                    port,
                    tp_size=tp_size,
                    extra=["--device", "cuda", "--dtype", "float32", "--base-gpu-id", str(base)],
                ),
                port=port,
                log_path=Path(os.environ.get("OUT", scratch)) / f"engine-fp32-tp{tp_size}.log",
            )
            try:
                engine.wait_until_up(timeout=300)
                report[f"fp32_tp{tp_size}_gpu{base}_equals_reference"] = (
                    asyncio.run(fp32_tokens(engine.url, prompts)) == report["reference_fp32"]
                )
            finally:
                engine.stop()
    for rank_memory in report["release"]:
        before, after = rank_memory["before"]["reserved"], rank_memory["after"]["reserved"]
        rank_memory["held_after_release_pct"] = round(100 * after / before, 2)
    for name in ("a", "b"):
        same = sum(
            x == y for g, r in zip(report[f"generate_{name}"], report[f"reference_{name}"]) for x, y in zip(g, r)
        )
        report[f"tp2_vs_one_gpu_token_agreement_{name}"] = f"{same}/{sum(len(r) for r in report[f'reference_{name}'])}"
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check_engine.json").write_text(text)


if __name__ == "__main__":
    main()
