"""Engine-trainer logprob mismatch on a tiny Qwen3-MoE, with and without routing replay, on CPU.

An embedded engine (bf16 by default, `--engine-dtype`) samples with --enable-return-routed-experts;
an fp32 FSDP2 trainer (one gloo rank) scores the same samples with `train.routing_replay` false and
true, and reports the trainer's own mismatch metric (`logprob_mismatch_mean/max`, the pre-update
|engine - trainer| logprob of each output token, as the GRPO loop logs it). `--router-scale s`
multiplies every router's weights by s: small s makes router logits near-tied, where bf16 rounding
flips expert choices (fragile routing, what replay is for); `--expert-scale e` multiplies the experts'
down projections, so that which experts run matters to the logits (at the tiny model's random init it
barely does). Sampling is seeded. Advantages are 0, so nothing is learned.

    python scripts/bench_routing_replay.py --router-scale 1 --router-scale 0.05 --expert-scale 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollfleet.engine.process.launch import EngineProcess, embedded_argv
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.sharding import init_distributed
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port
from rollfleet.wire.routed_experts import ROUTED_EXPERTS_FLAG


def tiny_moe(directory: Path, router_scale: float, expert_scale: float, seed: int) -> str:
    path = make_tiny_model(directory, "qwen3_moe", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(router_scale)
            layer.mlp.experts.down_proj.mul_(expert_scale)  # how much the chosen experts move the logits
    model.save_pretrained(path)
    return str(path)


async def sample(url: str, prompts: list[list[int]], n: int, max_new_tokens: int) -> list[dict]:
    async with EngineClient(url, timeout=600) as client:
        answers = await client.generate(
            input_ids=prompts,
            sampling_params={
                "n": n,
                "max_new_tokens": max_new_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": 0,
            },
            return_logprob=True,
            return_routed_experts=True,
        )
    return [
        {
            "prompt_ids": prompts[index // n],
            "output_ids": answer["output_ids"],
            "logprobs": [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]],
            "routed_experts": answer["meta_info"]["routed_experts"],
            "advantage": 0.0,
        }
        for index, answer in enumerate(answers)
    ]


def measure(model_path: str, args: argparse.Namespace, log_dir: Path) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in range(args.prompts)]
    port = free_port()
    argv = embedded_argv(model_path, port, extra=["--dtype", args.engine_dtype, ROUTED_EXPERTS_FLAG])
    engine = EngineProcess(argv, port=port, log_path=log_dir / "engine.log")
    try:
        engine.wait_until_up(timeout=300)
        batch = asyncio.run(sample(engine.url, prompts, args.n, args.max_new_tokens))
    finally:
        engine.stop()
    figures = {"tokens": sum(len(item["output_ids"]) for item in batch)}
    for replay in (False, True):
        config = TrainConfig(routing_replay=replay, micro_batch_size=len(batch), lr=1e-6)
        metrics = PolicyTrainer(model_path, config).train_step(batch)
        key = "replay" if replay else "no_replay"
        figures[key] = {m: metrics[f"logprob_mismatch_{m}"] for m in ("mean", "max")}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router-scale", type=float, action="append", help="repeatable; default 1")
    parser.add_argument("--expert-scale", type=float, default=1.0)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    init_distributed(0, 1, master_port=free_port(), backend="gloo")
    results = []
    for scale in args.router_scale or [1.0]:
        with tempfile.TemporaryDirectory() as tmp:
            model_path = tiny_moe(Path(tmp) / "moe", scale, args.expert_scale, args.seed)
            results.append({"router_scale": scale, **measure(model_path, args, Path(tmp))})
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "engine_dtype": args.engine_dtype}))


if __name__ == "__main__":
    main()
