"""A tp=2 engine whose batch fails on every rank (rank 0 and its follower, two real processes over
gloo): the batch's requests finish as aborted with the reason, the follower goes on, and the next
batch runs on both ranks; on the dense cache and on the paged pool (whose failed step once left the
follower waiting for an end of batch that never came: it died at rank 0's next step). The HTTP door
refuses the failing input, so rank 0 submits straight to its scheduler, as
rollfleet.engine.process.server does after the door."""

from __future__ import annotations

import queue
import traceback

import helper_processes
import pytest
import torch.distributed as dist
from conftest import reference_greedy

from rollfleet.wire.net import free_port

VOCAB = 320  # rollfleet.tiny_models' qwen3
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _rank(rank: int, model_path: str, port: int, results, kv: str) -> None:
    from transformers import AutoTokenizer

    from rollfleet.engine.kv.setup import paged_options, start_paged
    from rollfleet.engine.model.model import ModelRunner
    from rollfleet.engine.process.server_args import build_parser
    from rollfleet.engine.runtime.scheduler import Scheduler
    from rollfleet.engine.tp.lockstep import Action, Lockstep, follow
    from rollfleet.wire.protocol import SamplingParams

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        flags = ["--model-path", model_path, "--device", "cpu", "--tp-size", "2", "--max-running-requests", "8"]
        args = build_parser().parse_args([*flags, "--rollfleet-kv-cache", kv])
        runner = ModelRunner(model_path, tp_size=2, group=dist.group.WORLD, paged=paged_options(args))
        if rank == 1:
            follow(runner, dist.group.WORLD)
            results.put(("follower", "returned"))
            return
        lockstep = Lockstep(runner, dist.group.WORLD)
        batches = start_paged(args, runner, lockstep, 512)  # None on the dense cache
        assert (batches is None) == (kv == "dense")
        scheduler = Scheduler(
            lockstep,
            AutoTokenizer.from_pretrained(model_path),
            eos_token_ids=set(),
            context_length=512,
            max_running_requests=8,
            weight_version="default",
            vocab_size=VOCAB,
            batches=batches,
        )
        scheduler.start()
        answers = []
        # a prompt the door would refuse (a null token) fails on every rank before any collective
        for prompt in ([1, None], [1, 2]):
            (seq,) = scheduler.submit(prompt, SamplingParams(**GREEDY), rid=None, return_logprob=False)
            answers.append(seq.future.result(timeout=120))
        results.put(("rank 0", (answers, scheduler.dead_reason)))
        scheduler.stop()
        lockstep(Action.SHUTDOWN)
    except BaseException:
        results.put((f"rank {rank} raised", traceback.format_exc()))
        raise


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kv", ["dense", "paged"])
def test_a_batch_failing_on_every_rank_aborts_its_requests_and_both_ranks_go_on(qwen3_dir, kv):
    context = helper_processes.context()
    results, port = context.Queue(), free_port()
    procs = [context.Process(target=_rank, args=(rank, qwen3_dir, port, results, kv), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        reports = dict(results.get(timeout=300) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    except queue.Empty:
        reports = {"timeout": "no report from a rank within 300 s"}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert set(reports) == {"rank 0", "follower"}, reports
    (failed, good), dead_reason = reports["rank 0"]
    reason = failed["meta_info"]["finish_reason"]
    # the dense cache builds the prompt's tensor, the paged pool its rows: each fails in its own words
    why = "RuntimeError: Could not infer dtype" if kv == "dense" else "TypeError: 'NoneType' object cannot be"
    assert reason["type"] == "abort" and f"the engine failed this batch: {why}" in reason["message"], reason
    assert good["output_ids"] == reference_greedy(qwen3_dir, [1, 2], 4)[0]
    assert dead_reason is None
    assert [proc.exitcode for proc in procs] == [0, 0]
