"""The embedded engine server: `python -m rollfleet.engine.process.server --model-path DIR [--tp-size N]`.

Process tree: the process you start is tp rank 0. With `--tp-size N` it spawns N-1 follower
processes; together they form one torch.distributed group (gloo on CPU, NCCL on GPU, plus a
gloo group for control messages). Rank 0 serves HTTP and runs the scheduler; every model
action it takes is broadcast first (lockstep.py: `Lockstep`, `Action`), and followers execute the
same actions in the same order (`follow`). If any rank dies, the others exit: a half-dead engine never serves.
"""

from __future__ import annotations

# first: the imports below are a timed phase of the start (start_timing.py)
from rollfleet.engine.process.start_timing import StartTimer

# isort: split
import argparse
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rollfleet.engine.http.http_server import RequestBodyLimit, run_server
from rollfleet.engine.kv import saver as memory_saver
from rollfleet.engine.kv.setup import add_kv_flags, check_kv_args, paged_options, start_paged
from rollfleet.engine.lora.lora import LoraLimits
from rollfleet.engine.model.build import local_device, model_class
from rollfleet.engine.model.model import ModelRunner
from rollfleet.engine.process.serving_flags import add_serving_flags
from rollfleet.engine.tp.lockstep import Action, Lockstep, follow
from rollfleet.engine.weights.remote_args import add_remote_instance_flags, check_remote_instance_args
from rollfleet.wire.net import free_port
from rollfleet.wire.routed_experts import routing_shape

log = logging.getLogger("rollfleet.engine")
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
        help="serve LoRA adapters (merged into the weights for the batches that use them; nn.Linear targets only)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default: any)")
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="module names adapters may target (q_proj v_proj ...; 'all' or unset: any nn.Linear)",
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


def _init_distributed(args, rank: int, store) -> tuple[str, object]:
    device = local_device(args.device, args.base_gpu_id, rank)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=args.tp_size,
        device_id=torch.device(device) if backend == "nccl" else None,
    )
    group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return device, group


def _cap_memory(args, device: str) -> None:
    """--mem-fraction-static on a GPU: torch's allocator holds at most this share of the device, so an
    engine beside another on one GPU (a warm standby) cannot take the other's memory."""
    if args.mem_fraction_static is not None and device.startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(args.mem_fraction_static, torch.device(device))


def lora_limits(args: argparse.Namespace) -> LoraLimits | None:
    if not args.enable_lora:
        return None
    modules = args.lora_target_modules
    targets = None if modules is None or "all" in modules else frozenset(modules)
    return LoraLimits(max_rank=args.max_lora_rank, target_modules=targets, max_loaded=args.max_loaded_loras)


def _make_runner(args, device: str, group, mark=None) -> ModelRunner:
    return ModelRunner(
        args.model_path,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        device=device,
        dtype=resolve_dtype(args),
        dummy=args.load_format in ("dummy", "remote_instance"),  # remote_instance: received after the build
        group=group,
        lora=lora_limits(args),
        mark=mark,
        paged=paged_options(args),
    )


def _follower_main(args, rank: int, store_port: int, spawned_at: float, forked: bool = False) -> None:
    # forked: this module was imported long before (by the zygote), so the first line is now
    timer = StartTimer(spawned_at, first_line_at=time.time()) if forked else StartTimer(spawned_at)
    timer.mark("imports")
    # A stop signal to the process group is rank 0's to handle: it tells followers to shut down
    # in order; a follower that died first would fail rank 0's last broadcast.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_parent_dies()
    store = dist.TCPStore("127.0.0.1", store_port, args.tp_size, is_master=False)
    device, group = _init_distributed(args, rank, store)
    _cap_memory(args, device)
    timer.mark("device_and_group")
    runner = _make_runner(args, device, group, timer.mark)
    runner.ranks.gather(timer.phases)  # tells rank 0 this rank is ready, and how its start went
    follow(runner, group)
    dist.destroy_process_group()


def dump_stacks_if_hung() -> None:
    """ROLLFLEET_HANG_DUMP_S=N: print every thread's stack every N seconds (diagnosing hangs)."""
    seconds = float(os.environ.get("ROLLFLEET_HANG_DUMP_S", "0"))
    if seconds > 0:
        import faulthandler

        faulthandler.dump_traceback_later(seconds, repeat=True)


def _exit_when_parent_dies() -> None:
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _exit_when_a_follower_dies(procs) -> None:
    def watch():
        while all(p.is_alive() for p in procs):
            time.sleep(0.5)
        log.error("a tensor-parallel rank exited; stopping the engine")
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    timer = StartTimer.from_env()
    timer.mark("imports")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    saver_off = memory_saver.resolve(parser, args)  # before CUDA starts (the allocator's settings)
    dump_stacks_if_hung()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.warning("memory saver %s", f"off: {saver_off}" if saver_off else "on: kv_cache and cuda_graph pause in place")
    if args.random_seed is not None:
        log.warning("--random-seed %s is ignored: see --help", args.random_seed)
    timer.mark("args")
    store, procs = _start_followers(args, fork=timer.launch == "zygote") if args.tp_size > 1 else (None, [])
    timer.mark("followers_spawned")
    # Rank-local work first: it overlaps the followers' own imports, which rank 0's group init waits for.
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    timer.mark("tokenizer")
    model_class(args.model_path)  # imports the model's code (torch._dynamo and all): seconds
    timer.mark("model_code")
    group, device = None, local_device(args.device, args.base_gpu_id, 0)
    if store is not None:
        device, group = _init_distributed(args, 0, store)
    _cap_memory(args, device)
    timer.mark("device_and_group")
    runner = _make_runner(args, device, group, timer.mark)
    if procs:
        timer.followers = runner.ranks.gather(timer.phases)[1:]
        timer.mark("followers_ready")
    serve(args, runner, Lockstep(runner, group), tokenizer=tokenizer, timer=timer)
    for proc in procs:
        proc.join(timeout=10)


def _start_followers(args, fork: bool) -> tuple[dist.TCPStore, list]:
    """Start tp ranks 1.., before rank 0's own model work so that their start overlaps it; they join
    rank 0's group through the returned store. A spawned engine spawns them (fresh interpreters,
    seconds of imports each); an engine forked by the zygote forks them (nothing to import). The
    forks come before the store: its server runs a thread, and a fork must find none."""
    ranks = range(1, args.tp_size)
    if fork:
        port = free_port()  # taken meanwhile: the store fails, "address already in use", and the start is retried
        procs = [_start_follower("fork", args, rank, port) for rank in ranks]
        store = dist.TCPStore("127.0.0.1", port, args.tp_size, is_master=True, wait_for_workers=False)
    else:
        store = dist.TCPStore("127.0.0.1", 0, args.tp_size, is_master=True, wait_for_workers=False)
        procs = [_start_follower("spawn", args, rank, store.port) for rank in ranks]
    _exit_when_a_follower_dies(procs)
    return store, procs


def _start_follower(method: str, args, rank: int, store_port: int):
    context = multiprocessing.get_context(method)
    follower_args = (args, rank, store_port, time.time(), method == "fork")
    proc = context.Process(target=_follower_main, args=follower_args, daemon=True)
    proc.start()
    return proc


def serve(args, runner: ModelRunner, lockstep: Lockstep, *, tokenizer, timer: StartTimer) -> None:
    from rollfleet.engine.http.app import create_app
    from rollfleet.engine.http.remote_pull import load_at_start
    from rollfleet.engine.http.service import EngineService
    from rollfleet.engine.kv.capacity import max_running_requests
    from rollfleet.engine.runtime.scheduler import Scheduler

    # The HTTP thread waits this long for the GIL after each socket call (5 ms let a busy engine delay /health
    # by a second); the collector scanned the model's objects every few hundred steps (CPU steps 28 vs 39 ms).
    sys.setswitchinterval(0.001)
    gc.collect(), gc.freeze(), gc.set_threshold(20_000, 20, 20)
    batches = start_paged(args, runner, lockstep, _context_length(runner))  # None: transformers' own cache
    args.max_running_requests = max_running_requests(args, runner, _context_length(runner))
    scheduler = Scheduler(
        lockstep,
        tokenizer,
        eos_token_ids=_eos_token_ids(args.model_path, tokenizer),
        context_length=_context_length(runner),
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        vocab_size=runner.model.config.get_text_config().vocab_size,
        max_samples_per_request=args.max_samples_per_request,
        thread_setup=lambda: _bind_thread(runner),
        read_routes=lambda: runner.last_routes if runner.paged is None else runner.paged.last_routes,
        batches=batches,
    )
    scheduler.start()
    service = EngineService(args, runner, lockstep, scheduler, tokenizer)
    if args.load_format == "remote_instance":
        load_at_start(service)  # before /health answers: the engine is up either ready or with the reason
    app = RequestBodyLimit(create_app(service), args.max_request_bytes)
    timer.mark("server_setup")

    def listening() -> None:
        timer.mark("listening")
        service.start_breakdown.update(timer.breakdown())
        log.warning("%s", timer.line())

    try:
        run_server(app, args, on_listening=listening)
    finally:
        scheduler.stop()
        lockstep(Action.SHUTDOWN)


def _bind_thread(runner: ModelRunner) -> None:
    """The current CUDA device is per thread: NCCL work issued from the engine thread (weight-update
    groups) must see this rank's GPU, not GPU 0."""
    if runner.device.type == "cuda":
        torch.cuda.set_device(runner.device)


def _context_length(runner: ModelRunner) -> int:
    return int(getattr(runner.model.config, "max_position_embeddings", 2048))


def _eos_token_ids(model_path: str, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:  # no generation_config.json: the tokenizer's eos is the only stop token
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


if __name__ == "__main__":
    sys.exit(main())
