"""The embedded engine server's flags: the parser (SGLang's launch_server names), the checks that refuse
what the engine cannot do before any process starts, and the values read from them (dtype, LoRA limits)."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from rollfleet.engine.kv.setup import add_kv_flags, check_kv_args
from rollfleet.engine.lora.lora import LoraLimits
from rollfleet.engine.process.serving_flags import add_serving_flags
from rollfleet.engine.weights.remote_args import add_remote_instance_flags, check_remote_instance_args
from rollfleet.wire.routed_experts import routing_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollfleet serve",
        description="Embedded rollout engine with "
        "SGLang's HTTP protocol (flags named as python -m sglang.launch_server).",
    )
    p.add_argument("--model-path", required=True, help="HF causal LM directory (config, tokenizer, weights)")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel processes")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size inside the TP group")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline parallel: not available here (SGLang has it)")
    p.add_argument("--dp-size", type=int, default=1, help="data parallel: run one server per replica instead")
    p.add_argument("--base-gpu-id", type=int, default=0, help="first GPU of this engine (rank r uses base+r)")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy", "remote_instance"],
        help="dummy = weights allocated without values (no file read); not ready until weights are pushed. "
        "remote_instance = load them from a running engine of the same layout "
        "(R-Fork; the --remote-instance-weight-loader-* flags)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto = float32 on CPU, the checkpoint's dtype on GPU",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--weight-version", default="default")
    _add_limit_flags(p)
    add_kv_flags(p)
    add_remote_instance_flags(p)
    add_serving_flags(p)
    p.add_argument(
        "--random-seed",
        type=int,
        default=None,
        help="accepted for SGLang compatibility, ignored (a warning says so): a dummy start leaves weights "
        "without values, and sampling seeds come per request (sampling_params.sampling_seed)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (merged into the weights for the batches that use them; nn.Linear targets, "
        "and an untied embed_tokens at --tp-size 1)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default: any)")
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="module names adapters may target (q_proj v_proj embed_tokens ...; 'all' or unset: any targetable)",
    )
    p.add_argument("--max-loaded-loras", type=int, default=None, help="most adapters loaded at once (default: any)")
    p.add_argument("--enable-memory-saver", action="store_true", help="accepted; release/resume always works here")
    p.add_argument("--skip-server-warmup", action="store_true", help="accepted; the embedded engine has no warmup")
    p.add_argument("--log-level", default="warning")
    return p


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """How much one batch and one request may ask of the engine."""
    p.add_argument("--max-running-requests", type=int, help="largest batch (CPU: 64; GPU: sized from memory)")
    p.add_argument(
        "--max-samples-per-request",
        type=int,
        default=1024,
        help="most samples one /generate request may ask for (prompts x n); more is refused with 400",
    )
    p.add_argument(
        "--rollfleet-arrival-wait-ms",
        type=float,
        default=50.0,
        help="an idle engine waits up to this long, while generation requests are still being read, to "
        "start them as one batch (a GRPO step's wave of requests; a lone request never waits); 0: never",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body in bytes (default 8 MiB, about a million prompt tokens as input_ids); "
        "more is refused with 413. The HTTP thread parses bodies, so this bounds how long one request holds it",
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the embedded engine cannot do, with the fix, before any process starts."""
    if args.pp_size != 1:
        parser.error(
            f"--pp-size {args.pp_size}: the embedded engine has no pipeline parallel; "
            "SGLang does (rollout.backend=sglang), or use --pp-size 1 with --tp-size"
        )
    if args.dp_size != 1:
        parser.error(f"--dp-size {args.dp_size}: run one server per data-parallel replica (rollout.num_engines)")
    if args.tp_size < 1:
        parser.error(f"--tp-size {args.tp_size}: must be >= 1")
    if args.ep_size < 1 or args.tp_size % args.ep_size:
        parser.error(f"--ep-size {args.ep_size}: must divide --tp-size {args.tp_size}")
    if args.ep_size not in (1, args.tp_size):
        parser.error(
            f"--ep-size {args.ep_size}: the embedded engine (transformers' EP plan) needs "
            f"--ep-size 1 or equal to --tp-size {args.tp_size}; SGLang supports other splits"
        )
    lora_flags = {
        "--max-lora-rank": args.max_lora_rank,
        "--lora-target-modules": args.lora_target_modules,
        "--max-loaded-loras": args.max_loaded_loras,
    }
    given = [flag for flag, value in lora_flags.items() if value is not None]
    if given and not args.enable_lora:
        parser.error(f"{', '.join(given)} without --enable-lora: add --enable-lora, or drop them")
    for flag in ("--max-lora-rank", "--max-loaded-loras"):
        if lora_flags[flag] is not None and lora_flags[flag] < 1:
            parser.error(f"{flag} {lora_flags[flag]}: must be >= 1")
    for flag in ("--max-samples-per-request", "--max-request-bytes", "--max-running-requests"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    check_remote_instance_args(parser, args)
    check_kv_args(parser, args)
    if args.enable_return_routed_experts and routing_shape(AutoConfig.from_pretrained(args.model_path)) is None:
        parser.error(
            f"--enable-return-routed-experts: {args.model_path} is a dense model (its config has no experts), "
            "it routes no tokens: drop the flag, or serve a MoE model"
        )
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        parser.error(f"--mem-fraction-static {args.mem_fraction_static}: must be between 0 and 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.dtype != "auto":
        return DTYPES[args.dtype]
    if args.device == "cpu":
        return torch.float32
    config_dtype = getattr(AutoConfig.from_pretrained(args.model_path), "dtype", None)
    return config_dtype if isinstance(config_dtype, torch.dtype) else torch.bfloat16


def lora_limits(args: argparse.Namespace) -> LoraLimits | None:
    if not args.enable_lora:
        return None
    modules = args.lora_target_modules
    targets = None if modules is None or "all" in modules else frozenset(modules)
    return LoraLimits(max_rank=args.max_lora_rank, target_modules=targets, max_loaded=args.max_loaded_loras)
