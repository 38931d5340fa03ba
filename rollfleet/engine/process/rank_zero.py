"""Rank 0's serving side of the embedded engine, over the model runner the process tree built: the
paged KV pool's start, the scheduler, the engine service and the HTTP app, served until shutdown."""

from __future__ import annotations

import gc
import logging
import sys

import torch
from transformers import GenerationConfig

from rollfleet.engine.http.http_server import RequestBodyLimit, run_server
from rollfleet.engine.kv.setup import start_paged
from rollfleet.engine.model.model import ModelRunner
from rollfleet.engine.process.start_timing import StartTimer
from rollfleet.engine.runtime.arrivals import CountArrivals
from rollfleet.engine.tp.lockstep import Action, Lockstep

log = logging.getLogger("rollfleet.engine")


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
        arrival_wait_s=args.rollfleet_arrival_wait_ms / 1000,
    )
    scheduler.start()
    service = EngineService(args, runner, lockstep, scheduler, tokenizer)
    if args.load_format == "remote_instance":
        load_at_start(service)  # before /health answers: the engine is up either ready or with the reason
    app = CountArrivals(RequestBodyLimit(create_app(service), args.max_request_bytes), scheduler.arrivals)
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
