"""Every sender rank feeds the engine ranks on its own device (colocated tensor sync): the rank ->
engine-rank mapping from the layout, the lockstep decision, and real pushes from two sender
processes (a gloo group) into real engines (two tp=1 and one tp=2), verified by fingerprint;
a call refused mid-push and a rank whose source fails stop every rank, in bounded time."""

from __future__ import annotations

import pytest
from conftest import run
from feed_senders import SenderRanks

from rollfleet.layout import Layout, colocated_feeders
from rollfleet.weights.transports import EngineTarget
from rollfleet.weights.transports.tensor import DONE, FAILED, GO, _decide
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.client import EngineClient

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


@pytest.fixture(scope="module")
def engines(qwen3_server, weight_servers):
    """Engine ids 0 and 1 (tp=1) and 2 (tp=2), as feed_senders.FEEDERS has them: conftest's shared
    servers (whatever weights they hold, each test pushes the ones it checks)."""
    procs = [(qwen3_server, 1), (weight_servers["tp1"], 1), (weight_servers["tp2"], 2)]
    return [EngineTarget(engine_id=i, url=proc.url, num_ranks=tp, rank_offset=0) for i, (proc, tp) in enumerate(procs)]


@pytest.fixture(scope="module")
def senders(engines):
    """The two sender ranks, started once for the module's pushes."""
    ranks = SenderRanks(engines)
    yield ranks
    ranks.close()


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


def test_each_engine_rank_reads_the_buffer_of_the_rank_on_its_device(engines, senders, qwen3_dir_b):
    answers = senders.push(qwen3_dir_b, [("good", "fed-by-two")])
    (pid0, [(outcome, report, _, _)]), (pid1, [(outcome1, *_)]) = answers[0], answers[1]
    assert outcome == outcome1 == "ok"
    assert report.feeds == {0: [0], 1: [1], 2: [0, 1]}  # whose handles each engine rank got
    assert {rank: sender["pid"] for rank, sender in report.senders.items()} == {0: pid0, 1: pid1}
    assert {rank: sender["device"] for rank, sender in report.senders.items()} == {0: "cpu", 1: "cpu"}
    assert report.senders[0]["calls"] == report.senders[1]["calls"] == report.buckets > 2
    assert report.senders[0]["bytes"] == report.senders[1]["bytes"] == report.bytes
    assert unverified(report, engines) == {}  # every tensor of every engine (both tp ranks) and the version


@pytest.mark.parametrize("failure", ["refused", "broken"])
def test_a_failure_on_any_rank_stops_every_rank_and_the_next_push_verifies(engines, senders, qwen3_dir, failure):
    """A call refused mid-push (rank 0 sees it) or a source failing on rank 1 only: both ranks raise
    within the engines' answer time, no engine takes the version, and the next push verifies."""
    before = versions(engines)
    answers = senders.push(qwen3_dir, [(failure, f"bad-{failure}"), ("good", f"after-{failure}")])
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
