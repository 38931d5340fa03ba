"""A colocated fleet on a local Ray (4 fake GPUs, engines and FSDP ranks on the CPU): the real
TrainerGroup pushes with every rank feeding the engine ranks of its own bundle (two tp=1 engines,
then one tp=2 engine), the fleet verifies every engine's fingerprints, and a push an engine refuses
stops every rank at once, leaves the engines AWAITING_WEIGHTS, and the next push verifies."""

from __future__ import annotations

import pytest
import ray

from rollfleet.config import load_config
from rollfleet.fleet.lifecycle import EngineState
from rollfleet.train.loop import start_fleet_and_trainers
from rollfleet.train.metrics import TRAINER_MEMORY


def colocated(model_dir, log_dir, *overrides):
    cfg = load_config(
        None,
        [
            f"rollout.model_path={model_dir}",
            "rollout.use_gpu=true",
            "rollout.auto_restart=false",
            "rollout.placement=colocated",
            "rollout.gpus_per_worker=0.5",
            "trainer.world_size=2",
            "weight_sync.transport=tensor",
            "weight_sync.bucket_mb=0.1",  # several calls per push
            f"rollout.log_dir={log_dir}",
            *overrides,
        ],
    )
    return start_fleet_and_trainers(cfg)  # the trainer ranks build while the engines start


def gpus_of_engine_ranks(fleet) -> dict[tuple[int, int], list[str]]:
    """(engine id, rank in engine) -> the GPU ids Ray gave that rollout worker."""
    placements = ray.get([w.placement.remote() for w in fleet.workers])
    ranks = {info.rank: info for info in fleet.rollout.layout.ranks()}
    return {(ranks[p["rank"]].engine_id, ranks[p["rank"]].rank_in_engine): p["gpu_ids"] for p in placements}


def check_fed_from_own_bundle(fleet, trainers, report) -> None:
    """Each engine rank got the handles of the trainer rank on its own GPU (from what the ranks sent)."""
    trainer_gpus = trainers.gpu_ids()
    assert sorted(report.senders) == list(range(len(trainer_gpus)))
    for rank, sender in report.senders.items():
        assert sender["trainer_rank"] == rank and sender["gpu_ids"] == trainer_gpus[rank] and sender["calls"] > 2
    for (engine_id, rank_in_engine), gpus in gpus_of_engine_ranks(fleet).items():
        feeder = report.feeds[engine_id][rank_in_engine]
        assert report.senders[feeder]["gpu_ids"] == gpus


@pytest.fixture(scope="module")
def two_engines(local_ray, qwen3_dir, tmp_path_factory):
    fleet, trainers = colocated(qwen3_dir, tmp_path_factory.mktemp("logs"), "rollout.num_engines=2")
    yield fleet, trainers
    trainers.shutdown()
    fleet.shutdown()


def test_two_tp1_engines_each_fed_by_the_trainer_rank_of_its_bundle(two_engines):
    fleet, trainers = two_engines
    report = fleet.sync_from(trainers, "1")
    assert report.verified == [0, 1] and fleet.version == "1"
    assert report.feeds == {0: [0], 1: [1]}
    check_fed_from_own_bundle(fleet, trainers, report)


def test_a_refused_push_stops_every_rank_and_the_next_push_verifies(two_engines):
    """Engine 1 refuses the push's session (one is already open there): rank 0 raises the refusal,
    the other rank's error names it, well inside the engines' timeout; both engines wait for weights."""
    fleet, trainers = two_engines
    fleet.pool.call(1, "begin_weight_update")  # the push's own begin on engine 1 is refused
    with pytest.raises(Exception, match="already open"):  # the refusal itself, not a timeout, ends the push
        fleet.sync_from(trainers, "2")
    assert [s.lifecycle.state for s in fleet.slots] == [EngineState.AWAITING_WEIGHTS] * 2
    report = fleet.sync_from(trainers, "3")  # the failed push ended every session it met, ours too
    assert report.verified == [0, 1] and fleet.version == "3"
    assert [s.lifecycle.state for s in fleet.slots] == [EngineState.ACTIVE] * 2


def test_a_tp2_engine_takes_each_rank_from_the_trainer_rank_on_its_gpu(local_ray, qwen3_dir, tmp_path):
    fleet, trainers = colocated(qwen3_dir, tmp_path, "rollout.num_engines=1", "rollout.tp_size=2")
    try:
        report = fleet.sync_from(trainers, "1")
        assert report.verified == [0] and report.feeds == {0: [0, 1]}
        check_fed_from_own_bundle(fleet, trainers, report)
    finally:
        trainers.shutdown()
        fleet.shutdown()


@pytest.mark.parametrize("release_weights, release_kv_cache", [(True, True), (False, True), (False, False)])
def test_a_trainer_turn_releases_what_the_config_says_and_the_engines_serve_after(
    two_engines, release_weights, release_kv_cache
):
    """rollout.release_weights=false: the engines keep their weights through the trainer's turn (they
    keep their version, release no weight bytes) and the push writes into them; either way every tag
    released is resumed, so the engines generate after the turn. rollout.release_kv_cache=false: the
    engines release nothing and stay active through the turn; the trainer neither offloads nor gives
    its cache back (no memory figures)."""
    fleet, trainers = two_engines
    fleet.sync_from(trainers, "before")
    rollout, moves = fleet.rollout, {}
    update = {"release_weights": release_weights, "release_kv_cache": release_kv_cache}
    fleet.rollout = rollout.model_copy(update=update)
    try:
        with fleet.trainer_turn(trainers, moves=moves):
            held = [s.version for s in fleet.slots]
            states = [s.lifecycle.state for s in fleet.slots]
            report = fleet.sync_from(trainers, f"turn-{release_weights}-{release_kv_cache}")
    finally:
        fleet.rollout = rollout
    weight_bytes = sum(rank["weight_bytes"] for rank in fleet.pool.call(0, "memory"))  # one engine's
    if release_weights:
        assert held == ["", ""] and moves["engine_released_bytes"] == 2 * weight_bytes > 0
    else:
        assert held == ["before", "before"]
    if release_kv_cache:
        assert states == [EngineState.SLEEPING] * 2 and moves["engine_released_bytes"] >= 0
        assert moves["trainer_memory"] == dict.fromkeys(TRAINER_MEMORY)  # the offload ended the turn (CPU: None)
        assert moves["trainer_give_back_seconds"] > 0 and moves["engine_resume_seconds"] > 0
    else:
        assert states == [EngineState.ACTIVE] * 2 and "engine_released_bytes" not in moves
        assert "trainer_memory" not in moves and "engine_resume_seconds" not in moves
        assert "trainer_give_back_seconds" not in moves
    assert report.verified == [0, 1] and fleet.version == f"turn-{release_weights}-{release_kv_cache}"
    assert [s.lifecycle.state for s in fleet.slots] == [EngineState.ACTIVE] * 2
    # read from both engines before the release; the CPU engines capture no decode graphs
    assert (moves["engine_graph_captures_total"], moves["engine_graph_capture_seconds_total"]) == (0, 0.0)
    samples = fleet.generate([[1], [2]], n=2, sampling={"max_new_tokens": 2, "ignore_eos": True})
    assert {s.engine_id for s in samples} == {0, 1} and all(len(s.output_ids) == 2 for s in samples)
