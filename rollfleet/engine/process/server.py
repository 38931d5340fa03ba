"""The embedded engine server: `python -m rollfleet.engine.process.server --model-path DIR [--tp-size N]`.

Process tree: the process you start is tp rank 0. With `--tp-size N` it spawns N-1 follower
processes; together they form one torch.distributed group (gloo on CPU, NCCL on GPU, plus a
gloo group for control messages). Rank 0 serves HTTP and runs the scheduler; every model
action it takes is broadcast first (lockstep.py: `Lockstep`, `Action`), and followers execute the
same actions in the same order (`follow`). If any rank dies, the others exit: a half-dead engine never serves.

This module is the process tree; its flags are server_args.py's, and rank 0's serving side (scheduler,
service, HTTP app) is rank_zero.py's.
"""

from __future__ import annotations

# first: the imports below are a timed phase of the start (start_timing.py)
from rollfleet.engine.process.start_timing import StartTimer

# isort: split
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from rollfleet.engine.kv import saver as memory_saver
from rollfleet.engine.kv.setup import paged_options
from rollfleet.engine.model.build import local_device, model_class
from rollfleet.engine.model.model import ModelRunner
from rollfleet.engine.process.rank_zero import serve
from rollfleet.engine.process.server_args import build_parser, check_args, lora_limits, resolve_dtype
from rollfleet.engine.tp.lockstep import Lockstep, follow
from rollfleet.wire.net import free_port

log = logging.getLogger("rollfleet.engine")


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
    dump_stacks_if_hung()  # its stacks too, when the launcher asks (SIGUSR1)
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
    """ROLLFLEET_HANG_DUMP_S=N: print every thread's stack every N seconds (diagnosing hangs). SIGUSR1
    prints them once, into the log (the launcher sends it to an engine that never came up)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    seconds = float(os.environ.get("ROLLFLEET_HANG_DUMP_S", "0"))
    if seconds > 0:
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


if __name__ == "__main__":
    sys.exit(main())
