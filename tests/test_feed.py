"""Every sender rank feeds the engine ranks on its own device (colocated tensor sync): the rank ->
engine-rank mapping from the layout, the lockstep decision, and real pushes from two sender
processes (a gloo group) into real engines (two tp=1 and one tp=2), verified by fingerprint;
a call refused mid-push and a rank whose source fails stop every rank, in bounded time."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist
from conftest import engine_servers, run
from transformers import AutoModelForCausalLM

from rollfleet.config import TensorSync
from rollfleet.layout import Layout, colocated_feeders
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports import EngineTarget
from rollfleet.weights.transports.feed import RankFeed
from rollfleet.weights.transports.tensor import DONE, FAILED, GO, TensorTransport, _decide
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.client import EngineClient
from rollfleet.wire.net import free_port

# ---- the mapping and the decision (unit) ----------------------------------------------------------


@pytest.mark.parametrize(
    "layout, world, expected",
    [
        (Layout(num_engines=1), 1, {0: (0,)}),
        (Layout(num_engines=2), 2, {0: (0,), 1: (1,)}),
        (Layout(num_engines=1, tp_size=2), 2, {0: (0, 1)}),
        (Layout(num_engines=4), 4, {0: (0,), 1: (1,), 2: (2,), 3: (3,)}),
        (Layout(num_engines=2, tp_size=2), 4, {0: (0, 1), 1: (2, 3)}),
        (Layout(num_engines=1, tp_size=4, ep_size=2), 4, {0: (0, 1, 2, 3)}),
    ],
)
def test_colocated_feeders_give_each_engine_rank_the_trainer_rank_of_its_bundle(layout, world, expected):
    feeders = colocated_feeders(layout, world)
    assert feeders == expected
    for info in layout.ranks():  # rollout rank r (bundle r) is fed by trainer rank r (bundle r)
        assert feeders[info.engine_id][info.rank_in_engine] == info.rank


@pytest.mark.parametrize("layout, world", [(Layout(num_engines=2), 1), (Layout(num_engines=1, tp_size=2), 4)])
def test_colocated_feeders_refuse_a_trainer_world_that_does_not_match(layout, world):
    with pytest.raises(ValueError, match=f"trainer.world_size={world}.*set trainer.world_size={layout.world_size}"):
        colocated_feeders(layout, world)


def test_every_rank_decides_the_same_from_every_rank_state():
    assert _decide([("call", None), ("call", None)]) == (GO, None)
    assert _decide([("end", None), ("end", None)]) == (DONE, None)
    decision, why = _decide([("call", None), ("error", "OSError: no space")])
    assert decision == FAILED and why == "rank 1: OSError: no space"
    decision, why = _decide([("call", None), ("end", None)])
    assert decision == FAILED and "sender ranks [1] ran out of tensors" in why


# ---- pushes from two sender processes (integration) -----------------------------------------------

WORLD = 2
ENGINES = {"a": {}, "b": {}, "c": {"tp_size": 2}}  # engine ids 0, 1, 2 in this order
FEEDERS = {0: (0,), 1: (1,), 2: (0, 1)}  # engine 2's tp rank 1 reads rank 1's buffer


class BrokenOnRank:
    """A source that raises on one rank only, after some tensors (the others' sources are fine)."""

    def __init__(self, model, rank: int, broken_rank: int):
        self.inner, self.rank, self.broken_rank = ModuleSource(model), rank, broken_rank

    def named_tensors(self):
        for count, item in enumerate(self.inner.named_tensors()):
            if self.rank == self.broken_rank and count == 8:
                raise OSError("the disk under this rank's source went away")
            yield item


class LastLayerWrong:
    """Every rank sends the same tensor of a wrong shape in the last decoder layer: a late call is refused."""

    def __init__(self, model, rank: int):
        self.inner = ModuleSource(model)

    def named_tensors(self):
        for name, tensor in self.inner.named_tensors():
            yield (name, tensor[:-1]) if name.endswith("layers.1.mlp.down_proj.weight") else (name, tensor)


SOURCES = {
    "good": lambda model, rank: ModuleSource(model),
    "refused": LastLayerWrong,
    "broken": lambda model, rank: BrokenOnRank(model, rank, broken_rank=1),
}


def sender_rank(rank, port, model_dir, targets, pushes, results):
    """One sender process: joins the gloo group, pushes `pushes` (source kind, version) in order with
    one connected transport, and puts (rank, pid, [(outcome, report or error, seconds, each engine's
    weight version after it)])."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    feed = RankFeed(rank, WORLD, FEEDERS, RankFeed.new_group(120), {"sender": f"process {rank}"})
    transport = TensorTransport(TensorSync(bucket_mb=0.1), targets, feed=feed, timeout_s=60)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outcomes = []
    for kind, version in pushes:
        start = time.monotonic()
        try:
            outcome = ("ok", transport.send(SOURCES[kind](model, rank), version))
        except Exception as exc:  # noqa: BLE001  (the test reads it)
            outcome = ("error", f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - start
        held = [transport.pool.call(t.engine_id, "get_model_info")["weight_version"] for t in targets]
        outcomes.append((*outcome, seconds, held))
    transport.disconnect()
    dist.destroy_process_group()
    results.put((rank, os.getpid(), outcomes))


def push_from_two_ranks(model_dir, targets, pushes, timeout=300):
    """Every rank's (pid, outcomes), by rank; fails if a rank does not finish within `timeout`."""
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    procs = [
        context.Process(target=sender_rank, args=(rank, port, model_dir, targets, pushes, results))
        for rank in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    try:
        answers = {}
        for _ in procs:
            rank, pid, outcomes = results.get(timeout=timeout)  # a rank left hanging fails the test here
            answers[rank] = (pid, outcomes)
        return answers
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def engines(qwen3_dir, tmp_path_factory):
    plan = {key: (qwen3_dir, kwargs) for key, kwargs in ENGINES.items()}
    with engine_servers(plan, tmp_path_factory.mktemp("logs")) as procs:
        yield [
            EngineTarget(engine_id=i, url=procs[key].url, num_ranks=kwargs.get("tp_size", 1), rank_offset=0)
            for i, (key, kwargs) in enumerate(ENGINES.items())
        ]


def unverified(report, targets) -> dict[int, str]:
    async def check():
        clients = {t.engine_id: EngineClient(t.url, timeout=60) for t in targets}
        try:
            return await find_unverified(report, clients, "fingerprint")
        finally:
            for client in clients.values():
                await client.close()

    return run(check())


def versions(targets) -> list[str]:
    async def ask():
        answers = []
        for target in targets:
            async with EngineClient(target.url, timeout=60) as client:
                answers.append((await client.get_model_info())["weight_version"])
        return answers

    return run(ask())


def test_each_engine_rank_reads_the_buffer_of_the_rank_on_its_device(engines, qwen3_dir_b):
    answers = push_from_two_ranks(qwen3_dir_b, engines, [("good", "fed-by-two")])
    (pid0, [(outcome, report, _, _)]), (pid1, [(outcome1, *_)]) = answers[0], answers[1]
    assert outcome == outcome1 == "ok"
    assert report.feeds == {0: [0], 1: [1], 2: [0, 1]}  # whose handles each engine rank got
    assert {rank: sender["pid"] for rank, sender in report.senders.items()} == {0: pid0, 1: pid1}
    assert {rank: sender["device"] for rank, sender in report.senders.items()} == {0: "cpu", 1: "cpu"}
    assert report.senders[0]["calls"] == report.senders[1]["calls"] == report.buckets > 2
    assert report.senders[0]["bytes"] == report.senders[1]["bytes"] == report.bytes
    assert unverified(report, engines) == {}  # every tensor of every engine (both tp ranks) and the version


@pytest.mark.parametrize("failure", ["refused", "broken"])
def test_a_failure_on_any_rank_stops_every_rank_and_the_next_push_verifies(engines, qwen3_dir, failure):
    """A call refused mid-push (rank 0 sees it) or a source failing on rank 1 only: both ranks raise
    within the engines' answer time, no engine takes the version, and the next push verifies."""
    before = versions(engines)
    answers = push_from_two_ranks(qwen3_dir, engines, [(failure, f"bad-{failure}"), ("good", f"after-{failure}")])
    (_, [failed0, good0]), (_, [failed1, good1]) = answers[0], answers[1]
    assert failed0[0] == failed1[0] == "error" and failed0[2] < 60 and failed1[2] < 60
    if failure == "refused":
        assert "layers.1.mlp.down_proj.weight" in failed0[1]  # engine's refusal of a late call
    else:
        assert "rank 1: OSError: the disk under this rank's source went away" in failed0[1]
    assert failed1[1].startswith("WeightFeedError: weight push stopped on rank 1: rank 0 reports")
    assert failed0[3] == before  # nothing committed: the old label stays (served or not)
    assert good0[0] == good1[0] == "ok" and good0[3] == [f"after-{failure}"] * 3
    assert unverified(good0[1], engines) == {}
