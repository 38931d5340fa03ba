"""Warm standby engines (`rollout.standby_engines`): engines started ahead of need with a dummy load
(AWAITING_WEIGHTS), each on GPUs (placement-group bundles) of its own, that take a dead engine's
place so that no engine restart lies on the path from a death back to serving.

- A standby is an `EngineSlot` with `standby` set: it is up and watched (death watch, probes: a
  dead standby is restarted like any engine, and stays a standby), but it is not routed (never
  ACTIVE), not a weight target (no pushes, no sleep or wake) and not restored.
- `promote` (under Recovery's lock, at the start of `Recovery.restart_inactive`): each INACTIVE
  serving engine swaps roles with a standby that is up. The standby becomes a serving engine still
  AWAITING_WEIGHTS, restored at once (peer first, then the next sources) and verified before it is
  ACTIVE; the dead slot becomes the standby, restarted afterwards with a dummy load.
- A LoRA run never sends base weights (only the adapter moves), so there a standby starts with the
  base weights from the model path (`standby_format`) and is restored with the current adapter.
- So the engines in rotation stay `rollout.num_engines`; engine ids of serving engines change.
- Disaggregated fleets only. A standby lives on GPUs of its own (a spare GPU), or beside a serving
  engine (`rollout.standby_beside`): then its workers share that engine's placement-group bundles
  (half a GPU each in Ray's books) and the two split each GPU's memory by their fractions
  (`rollfleet.config.standby`; the config refuses a split that does not fit). Beside a colocated
  engine (memory released while the trainer holds it) is not built, and the config refuses it.
"""

from __future__ import annotations

import logging

from rollfleet.config import RolloutConfig
from rollfleet.config.standby import mem_fraction
from rollfleet.fleet.lifecycle import EngineSlot, EngineState
from rollfleet.layout import RankInfo
from rollfleet.weights.transports.base import transport_class

log = logging.getLogger("rollfleet.standby")
STANDBY_LOAD_FORMAT = "dummy"  # a standby holds no weights of value: it is restored when it takes a place


def standby_format(weight_sync) -> str:
    """A standby's load: dummy, or (a transport that sends no base weights: LoRA) what a restarted
    engine loads, the base weights from the model path."""
    transport = transport_class(weight_sync)
    return STANDBY_LOAD_FORMAT if transport.sends_full_weights else transport.restart_load_format


def with_standbys(rollout: RolloutConfig) -> RolloutConfig:
    """The rollout config the fleet lays out and places: engines 0..num_engines-1 serve, the
    `standby_engines` after them are standbys, each with bundles (GPUs) of its own."""
    total = rollout.num_engines + rollout.standby_engines
    return rollout.model_copy(update={"num_engines": total, "standby_engines": 0})


def bundle_count(rollout: RolloutConfig) -> int:
    """Placement-group bundles (GPUs) the fleet needs: standbys beside an engine bring none."""
    standbys = 0 if rollout.standby_beside else rollout.standby_engines
    return (rollout.num_engines + standbys) * rollout.gpus_per_engine


def bundle_index(rollout: RolloutConfig, rank: RankInfo) -> int:
    """The bundle of a rank of the placed fleet (serving engines, then standbys): its own, or, for a
    standby beside engine e, the bundle of e's rank at the same position."""
    standby = rank.engine_id - rollout.num_engines
    if standby < 0 or not rollout.standby_beside:
        return rank.rank
    per_engine = rollout.gpus_per_engine
    return rollout.standby_beside[standby] * per_engine + rank.rank % per_engine


def bundle_share(rollout: RolloutConfig, rank: RankInfo) -> float:
    """The share of its bundle a rank's worker reserves: a bundle two processes live on is split."""
    hosts = set(rollout.standby_beside)
    shared = rank.engine_id >= rollout.num_engines or rank.engine_id in hosts
    return 0.5 if rollout.standby_beside and shared else 1.0


def with_mem_fraction(rollout: RolloutConfig, engine_id: int) -> RolloutConfig:
    """The rollout config engine `engine_id`'s worker starts it with: its memory fraction as a flag."""
    fraction = mem_fraction(rollout, engine_id)
    if fraction is None:
        return rollout
    return rollout.model_copy(
        update={"server_extras": [*rollout.server_extras, "--mem-fraction-static", str(fraction)]}
    )


def start_format(engine_id: int, cfg, load_format: str) -> str:
    """The load format an engine of a new fleet (of run config `cfg`) starts with: a standby's is
    `standby_format`."""
    return standby_format(cfg.weight_sync) if engine_id >= cfg.rollout.num_engines else load_format


def mark_started(slots: list[EngineSlot], num_engines: int, load_format: str) -> None:
    """The engines of a new fleet are up: serving ones ACTIVE (or AWAITING_WEIGHTS after a dummy
    load), standbys AWAITING_WEIGHTS for good (until one takes a dead engine's place)."""
    for slot in slots:
        slot.standby = slot.engine_id >= num_engines
        if slot.standby:
            slot.version = ""  # it holds no verified weights
            slot.lifecycle.to(EngineState.AWAITING_WEIGHTS, "started as a standby")
        else:
            ready = EngineState.AWAITING_WEIGHTS if load_format == "dummy" else EngineState.ACTIVE
            slot.lifecycle.to(ready, f"started ({load_format} weights)")


def in_rotation(slots: list[EngineSlot]) -> list[EngineSlot]:
    """The serving engines' slots (standbys left out): what pushes, sleep, wake and restores cover."""
    return [s for s in slots if not s.standby]


def promote(slots: list[EngineSlot]) -> list[EngineSlot]:
    """Called under Recovery's lock. Each INACTIVE serving engine hands its place to a standby that
    is up (AWAITING_WEIGHTS, at a url the death watch follows); the dead slot becomes the standby to
    restart. The promoted slots, still AWAITING_WEIGHTS (a restore or push must verify them)."""
    ready = [s for s in slots if s.standby and s.state == EngineState.AWAITING_WEIGHTS]
    promoted = []
    for dead in [s for s in slots if not s.standby and s.state == EngineState.INACTIVE]:
        if not ready:
            break
        spare = ready.pop(0)
        dead.standby, spare.standby = True, False
        dead.version = spare.version = ""
        log.info(
            "engine %d takes the place of dead engine %d (which restarts as a standby)", spare.engine_id, dead.engine_id
        )
        promoted.append(spare)
    return promoted
