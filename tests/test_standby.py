"""Warm standby engines on a real Ray fleet (2 serving engines + 1 standby beside engine 1 on its
GPU, as on a machine of 2 GPUs; tiny model, CPU): a killed engine's place is taken by the standby,
restored from its peer and verified before it serves, generate loses and duplicates nothing
meanwhile, the dead slot comes back as the standby (forked by its worker's zygote: no imports), and
pushes go to the serving engines only; under chaos (a hung engine, a kill at a random moment) every
prompt is answered exactly once. Layouts that cannot fit are refused with the sums."""

from __future__ import annotations

import threading

import pytest
import ray
from conftest import hold_with_requests, kill, pause_engine, reference_greedy, stop
from transformers import AutoModelForCausalLM
from waits import chaos_rng, fleet_state, wait_until

from rollfleet.config import ConfigError, load_config
from rollfleet.fleet import standby
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[4, 8, 15], [16, 23, 42], [7, 7], [1, 2], [3, 1, 4, 1], [5, 9, 2, 6]]


@pytest.fixture(scope="module")
def fleet(local_ray, qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("standby")
    cfg = load_config(
        None,
        [
            f"rollout.model_path={qwen3_dir}",
            "rollout.use_gpu=true",  # Ray GPUs for placement; the engines run on the CPU
            "rollout.num_engines=2",
            "rollout.standby_engines=1",
            "rollout.standby_beside=[1]",  # 2 GPUs: engine 0 on one, engine 1 and the standby on the other
            "rollout.mem_fraction_static=0.5",
            "rollout.standby_mem_fraction_static=0.45",
            f"rollout.log_dir={out}/logs",
            "rollout.recovery_wait_s=60",
            "rollout.probe_interval_s=0.5",
            "rollout.probe_timeout_s=2",
            "rollout.probe_failures=2",  # a hang is caught in about 5 s (test_recovery's settings)
            "rollout.restore_timeout_s=30",
            "weight_sync.transport=disk",
            f"weight_sync.path={out}/sync",
        ],
    )
    fleet = Fleet.from_config(cfg)
    yield fleet
    fleet.shutdown()


def roles(fleet):
    return {s.engine_id: (s.state.value, s.standby) for s in fleet.slots}


@pytest.fixture
def settled(fleet):
    """The fleet with its two serving engines ACTIVE and its standby up, whatever a test before left:
    each test sets up the state it asserts on. Returns (serving engine ids, the standby's id)."""
    wait_until(lambda: _settled(fleet), what=f"a settled fleet, roles {roles(fleet)}", state=lambda: fleet_state(fleet))
    every = [s.engine_id for s in fleet.slots]
    fleet.pool.on_all("continue_generation", every)  # a test that failed may have left one paused
    return [s.engine_id for s in fleet.slots if not s.standby], next(s.engine_id for s in fleet.slots if s.standby)


def _generating(fleet, prompts, **kwargs) -> tuple[threading.Thread, dict]:
    results: dict = {}
    thread = threading.Thread(target=lambda: results.update(out=fleet.generate(prompts, **kwargs)))
    thread.start()
    return thread, results


def test_standby_engines_are_refused_on_a_colocated_fleet():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.model_path=m", "rollout.placement=colocated", "rollout.standby_engines=1"])
    message = str(err.value)
    assert "standby_engines" in message and "1" in message and "placement=disaggregated" in message
    cfg = load_config(None, ["rollout.model_path=m", "rollout.standby_engines=2"])
    assert cfg.rollout.standby_engines == 2 and cfg.rollout.num_engines == 1


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.standby_beside=[1]"], ["standby_beside=[1]", "mem_fraction_static", "standby_mem_fraction_static"]),
        (["rollout.standby_beside=[0, 1]"], ["standby_beside=[0, 1]", "2 standbys", "standby_engines=1"]),
        (["rollout.standby_beside=[2]"], ["standby_beside=[2]", "not serving engines", "num_engines=2"]),
        (
            [
                "rollout.standby_beside=[1]",
                "rollout.mem_fraction_static=0.6",
                "rollout.standby_mem_fraction_static=0.5",
            ],
            ["engine 1's GPUs would hold 0.6 + 1 x 0.5 = 1.10", "lower rollout.mem_fraction_static"],
        ),
    ],
)
def test_layouts_that_cannot_fit_a_standby_beside_an_engine_are_refused(overrides, words):
    base = ["rollout.model_path=m", "rollout.num_engines=2", "rollout.standby_engines=1"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, *overrides])
    assert all(word in str(err.value) for word in words), str(err.value)
    fits = ["rollout.standby_beside=[1]", "rollout.mem_fraction_static=0.5", "rollout.standby_mem_fraction_static=0.5"]
    assert load_config(None, [*base, *fits]).rollout.standby_beside == [1]


def test_the_standby_lives_beside_engine_1_on_its_gpu(fleet, settled):
    # slots keep their GPUs and memory fractions when roles swap: slot 2 is the standby as started
    gpus = [s.gpu_ids for s in fleet.slots]
    assert gpus[2] == gpus[1] and gpus[0] != gpus[1], gpus  # two Ray GPUs, the standby on engine 1's
    argv = ray.get(fleet.slots[2].head.engine_argv.remote())
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.45"


def test_a_standby_takes_a_dead_engines_place_and_the_dead_one_becomes_the_standby(fleet, settled, qwen3_dir_b):
    serving, spare = settled
    victim, peer = serving
    trained = AutoModelForCausalLM.from_pretrained(qwen3_dir_b)
    assert fleet.sync_weights(ModuleSource(trained), "v1").verified == serving  # the standby takes no push
    assert fleet.slots[spare].version == "" and fleet.slots[spare].state.value == "AWAITING_WEIGHTS"

    prompts = PROMPTS * 10
    pause_engine(fleet, victim)  # before the generate: its requests cannot all be done before the hold
    generating, results = _generating(fleet, prompts, n=2, sampling=GREEDY)
    hold_with_requests(fleet, victim, alive=generating.is_alive, steps=1)  # its requests mid-generation
    mark = fleet.slots[victim].lifecycle.mark()
    kill(fleet, victim)
    wait_until(
        lambda: fleet.slots[spare].state.value == "ACTIVE", what="the standby ACTIVE", state=lambda: fleet_state(fleet)
    )
    assert not fleet.slots[spare].standby and fleet.slots[spare].version == "v1"
    down = [t for t in fleet.slots[victim].lifecycle.since(mark) if t.new.value == "INACTIVE"]
    assert down and "process exited" in down[0].why, down  # caught by the death watch or the router
    assert fleet.slots[spare].lifecycle.history[-1].why.endswith("(peer)")  # restored from the peer, verified
    assert fleet.pool.call(spare, "weights_fingerprint", None) == fleet.pool.call(peer, "weights_fingerprint", None)
    generating.join()

    samples = results["out"]  # nothing lost, nothing twice, every answer the trained model's
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (i, k) for i in range(len(prompts)) for k in (0, 1)
    ]
    assert {s.weight_version for s in samples} == {"v1"}
    expected = {tuple(p): reference_greedy(qwen3_dir_b, p, 8)[0] for p in PROMPTS}
    assert all(s.output_ids == expected[tuple(s.prompt_ids)] for s in samples)

    # the dead slot restarts in the background as the standby: dummy weights, not routed
    wait_until(
        lambda: roles(fleet)[victim] == ("AWAITING_WEIGHTS", True),
        what="the dead slot back as the standby",
        state=lambda: fleet_state(fleet),
    )
    assert fleet.slots[victim].version == "" and "as a standby" in fleet.slots[victim].lifecycle.history[-1].why
    start = fleet.pool.call(victim, "get_server_info")["start_breakdown"]
    assert start["launch"] == "zygote", start  # forked by the worker's zygote: no imports to pay
    after = fleet.generate(PROMPTS * 2, sampling=GREEDY)
    assert {s.engine_id for s in after} == {peer, spare}


def test_pushes_go_to_the_serving_engines_and_a_dead_standby_is_restarted(fleet, settled, qwen3_dir):
    serving, spare = settled
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    report = fleet.sync_weights(ModuleSource(base), "v2")
    assert report.engine_ids == serving and report.verified == serving and fleet.version == "v2"
    assert fleet.slots[spare].version == "" and fleet.slots[spare].state.value == "AWAITING_WEIGHTS"
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    assert all(s.output_ids == reference_greedy(qwen3_dir, s.prompt_ids, 8)[0] for s in samples)

    url, before, mark = fleet.slots[spare].url, roles(fleet), fleet.slots[spare].lifecycle.mark()
    kill(fleet, spare)  # the standby dies: it comes back as a standby, and no serving engine moves
    wait_until(
        lambda: fleet.slots[spare].url != url and roles(fleet)[spare] == ("AWAITING_WEIGHTS", True),
        what="the killed standby restarted as a standby",
        state=lambda: fleet_state(fleet),
    )
    assert roles(fleet) == before
    assert any("process exited" in t.why for t in fleet.slots[spare].lifecycle.since(mark))


def test_chaos_a_hung_then_a_killed_engine_are_replaced_by_standbys_and_no_prompt_is_lost(fleet, settled, qwen3_dir):
    """The chaos test's faults (tests/test_grpo_loop.py) on a fleet with a standby: a serving engine
    hangs (SIGSTOP) during a generate, the probes catch it and the standby takes its place; then a
    serving engine is killed at a random step of the next generate, and the standby that came back
    in the meantime takes that place. Every prompt is answered exactly once, at the fleet's version."""
    rng = chaos_rng()
    base = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert fleet.sync_weights(ModuleSource(base), "chaos").verified == settled[0]
    for fault in (stop, kill):
        _fault_during_generate(fleet, fault, rng, qwen3_dir)
    whys = [t.why for s in fleet.slots for t in s.lifecycle.history]
    assert any("health probes failed" in why for why in whys) and any("process exited" in why for why in whys)


def _fault_during_generate(fleet, fault, rng, base_dir) -> None:
    """`fault` hits a serving engine at a random step of a generate (its requests queued or k tokens
    in: the engine held and stepped, so the generate is under way by construction); the standby
    takes its place."""
    serving = [s.engine_id for s in fleet.slots if not s.standby]
    spare = next(s.engine_id for s in fleet.slots if s.standby)
    prompts = PROMPTS * 8
    victim = rng.choice(serving)
    pause_engine(fleet, victim)  # before the generate: its requests cannot all be done before the hold
    generating, results = _generating(fleet, prompts, sampling=GREEDY)
    hold_with_requests(fleet, victim, alive=generating.is_alive, steps=rng.randint(0, 6))
    fault(fleet, victim)
    wait_until(
        lambda: roles(fleet)[spare] == ("ACTIVE", False), what="the standby ACTIVE", state=lambda: fleet_state(fleet)
    )
    generating.join()
    samples = results["out"]
    assert sorted(s.prompt_index for s in samples) == list(range(len(prompts)))  # none lost, none twice
    assert {s.weight_version for s in samples} == {fleet.version}
    expected = {tuple(p): reference_greedy(base_dir, p, 8)[0] for p in PROMPTS}  # v2 is the base model
    assert all(s.output_ids == expected[tuple(s.prompt_ids)] for s in samples)
    wait_until(
        lambda: roles(fleet)[victim] == ("AWAITING_WEIGHTS", True) and _settled(fleet),
        what="settled again",
        state=lambda: fleet_state(fleet),
    )


def _settled(fleet) -> bool:
    """Every serving engine ACTIVE and the standby up."""
    return sorted(roles(fleet).values()) == [("ACTIVE", False), ("ACTIVE", False), ("AWAITING_WEIGHTS", True)]


def test_standby_ranks_share_their_host_engines_bundles_at_tp_2():
    """Engines 0 and 1 (tp 2) on bundles 0-3; standby 2 beside engine 0 shares bundles 0 and 1."""
    rollout = load_config(
        None,
        [
            "rollout.model_path=m",
            "rollout.num_engines=2",
            "rollout.tp_size=2",
            "rollout.standby_engines=1",
            "rollout.standby_beside=[0]",
            "rollout.mem_fraction_static=0.5",
            "rollout.standby_mem_fraction_static=0.4",
        ],
    ).rollout
    ranks = standby.with_standbys(rollout).layout.ranks()
    assert standby.bundle_count(rollout) == 4 and len(ranks) == 6
    assert [standby.bundle_index(rollout, r) for r in ranks] == [0, 1, 2, 3, 0, 1]
    assert [standby.bundle_share(rollout, r) for r in ranks] == [0.5, 0.5, 1.0, 1.0, 0.5, 0.5]
    fractions = [standby.with_mem_fraction(rollout, e).server_extras for e in (0, 2)]
    assert fractions == [["--mem-fraction-static", "0.5"], ["--mem-fraction-static", "0.4"]]
