"""The colocated choreography (`Fleet.trainer_turn`): engines release the GPUs to the trainer for
its turn and take them back after, with the bytes and seconds of every move recorded.

Order on entry: no engine restart may start (the trainer is about to hold the GPUs); engines
release their KV cache, CUDA graphs and (with `rollout.release_weights`) weights; then
the trainer onloads (it needs the memory they freed). Inside: train, then `Fleet.sync_from` (which
resumes released weights first). On exit, also after an error: the trainer offloads (after the
push: its parameters are what was sent) and gives its cached device memory back, offloaded or not
(`PolicyTrainer.offload`); the engines resume their CUDA graphs, then their KV cache; restarts may
start again. No engine allocates before the trainer gave its memory back: every engine's resume is
called after the offload returned (`_offload_and_resume`).
This is SGLang's order (slime's too): resume weights, push, resume CUDA graphs and KV cache. Every
tag released is resumed: SGLang keeps a released tag's memory unmapped until it is resumed, and its
next CUDA graph replay would read unmapped memory.

With `rollout.release_kv_cache` false (the memory plan sized the engines' share so that the trainer's
whole turn fits beside it, and capped the trainer's allocator there) none of this happens: the turn is
the training and the push, nothing is released, offloaded, given back or resumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

from rollfleet.fleet.seams import Trainers, TurnFleet
from rollfleet.wire.errors import RESUME_REFUSED, EngineError

# SGLang's memory tags (sglang.srt.constants); the embedded engine drops its decode graphs on a release
RESUME_AFTER_PUSH = ["cuda_graph", "kv_cache"]


class ColocatedMemoryError(RuntimeError):
    """The engines could not take their memory back after the trainer's turn."""


def release_tags(release_weights: bool | str) -> list[str]:
    """What the engines release for the trainer's turn. A run's memory plan resolved `auto`
    (rollfleet.train.memory_setup); a fleet built without one releases, as fleets did before the plan."""
    return ["kv_cache", "cuda_graph"] if release_weights is False else ["kv_cache", "weights", "cuda_graph"]


def freed_bytes(answers: list) -> int:
    """Device memory the engines' release answers report freed (allocated before - after, per rank;
    on CPU the weights' bytes). SGLang reports no figures: 0."""
    total = 0
    for answer in answers:
        for rank in (answer or {}).get("memory") or []:
            before, after = rank.get("before", {}), rank.get("after", {})
            key = "allocated" if "allocated" in before else "weight_bytes"
            total += max(before.get(key, 0) - after.get(key, 0), 0)
    return total


def graph_totals(fleet: TurnFleet) -> tuple[int, float]:
    """Decode CUDA graph captures so far and their seconds, over the running embedded engines (each
    release drops an engine's graphs; the next generate captures them again). SGLang: (0, 0.0)."""
    if fleet.rollout.backend != "embedded":
        return 0, 0.0
    graphs = [
        ((info or {}).get("rollfleet_kv_cache") or {}).get("cuda_graphs") or {}
        for info in fleet.pool.on_all("get_server_info", fleet.running())
    ]
    return sum(g.get("captures", 0) for g in graphs), sum(g.get("capture_s", 0.0) for g in graphs)


def _moved(figures: dict | None) -> tuple[int, float]:
    figures = figures or {}
    return int(figures.get("bytes", 0)), float(figures.get("seconds", 0.0))


def _offloaded(moves: dict, figures: dict | None) -> None:
    """The offload's bytes and seconds, and the trainer's device memory around it (`trainer_memory`)."""
    moves["trainer_offload_bytes"], moves["trainer_offload_seconds"] = _moved(figures)
    moves["trainer_memory"] = (figures or {}).get("memory")


@contextmanager
def trainer_turn(
    fleet: TurnFleet, trainers: Trainers, timed: Callable[[str], object] | None = None, moves: dict | None = None
):
    """See the module docstring; `timed("sleep_wake")` times the memory moves and `moves` (a dict)
    receives their bytes and seconds: trainer_onload/offload_bytes/_seconds, trainer_give_back_seconds,
    engine_release_seconds, engine_released_bytes, engine_resume_seconds, and the engines' graph captures so far
    (engine_graph_captures_total, engine_graph_capture_seconds_total: read before the release)."""
    if fleet.rollout.placement != "colocated":
        yield
        return
    timed = timed or (lambda phase: nullcontext())
    moves = {} if moves is None else moves
    with fleet.recovery.paused():
        moves["engine_graph_captures_total"], moves["engine_graph_capture_seconds_total"] = graph_totals(fleet)
        if fleet.rollout.release_kv_cache is False:  # the plan fits both turns at once: nothing moves
            yield
            return
        with timed("sleep_wake"):
            start = time.perf_counter()
            moves["engine_released_bytes"] = freed_bytes(fleet.sleep(release_tags(fleet.rollout.release_weights)))
            moves["engine_release_seconds"] = time.perf_counter() - start
            moves["trainer_onload_bytes"], moves["trainer_onload_seconds"] = _moved(trainers.onload())
        try:
            yield
        finally:
            with timed("sleep_wake"):
                _offload_and_resume(fleet, trainers, moves)


def _offload_and_resume(fleet: TurnFleet, trainers: Trainers, moves: dict) -> None:
    """The trainer's offload and give-back, then the engines' resume: one after the other on every
    backend. An engine's resume maps its KV pool's memory at once (SGLang's and the embedded engine's
    paged pool alike: through torch_memory_saver, or a new allocation without it), so it must come
    after the trainer freed the GPU and emptied its cache, or the two meet at the peak."""
    start = time.perf_counter()
    _offloaded(moves, trainers.offload())
    moves["trainer_give_back_seconds"] = time.perf_counter() - start  # the offload, if any, and the cache's return
    start = time.perf_counter()
    try:
        fleet.wake(RESUME_AFTER_PUSH)
    except EngineError as exc:
        if exc.status_code != 400 or RESUME_REFUSED not in exc.message:
            raise
        fraction = fleet.rollout.mem_fraction_static
        raise ColocatedMemoryError(refused_resume(exc.message, fraction, moves.get("trainer_memory"))) from exc
    moves["engine_resume_seconds"] = time.perf_counter() - start


def refused_resume(engine_message: str, fraction: float | None, trainer_memory: dict | None) -> str:
    """The run's words for an engine's refused resume: what the trainer kept, and the settings that fix it."""
    kept = ""
    if trainer_memory and trainer_memory.get("allocated_after") is not None:
        gib = 1 << 30
        allocated, reserved = trainer_memory["allocated_after"] / gib, trainer_memory["reserved_after"] / gib
        kept = f" The trainer kept {allocated:.2f} GiB allocated ({reserved:.2f} GiB reserved) after its give-back."
    return (
        f"the engines could not take their memory back after the trainer's turn: {engine_message}.{kept} "
        f"Give the engines less (rollout.mem_fraction_static, {fraction if fraction is not None else 'unset'} now) "
        "or move the trainer's state off the GPU for its turn (train.offload=true); the run's memory-plan.json "
        "says what the plan expected each part to take"
    )
