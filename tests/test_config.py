"""Run config: YAML, dotted overrides, and errors that name field, value and fix."""

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollfleet.config import ConfigError, RunConfig, SamplingDefaults, load_config, parse_config

MODEL = "rollout.model_path=/models/tiny"


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def error_of(*overrides, path=None):
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return str(err.value)


# --- loading ------------------------------------------------------------------------------


def test_defaults_and_derived_sizes():
    cfg = load_config(None, [MODEL])
    rollout = cfg.rollout
    assert (rollout.backend, rollout.placement, rollout.use_gpu) == ("embedded", "disaggregated", False)
    assert (rollout.num_engines, rollout.tp_size, rollout.pp_size, rollout.ep_size) == (1, 1, 1, 1)
    assert rollout.sampling == SamplingDefaults()
    assert (rollout.sampling.max_new_tokens, rollout.sampling.top_k, rollout.sampling.stop) == (128, -1, [])
    assert cfg.trainer.world_size == 1 and cfg.ray.address is None
    assert rollout.startup_timeout_s == 300 and rollout.log_dir == "logs/engines"


def test_world_size_and_gpus_per_engine():
    cfg = load_config(
        None, [MODEL, "rollout.backend=sglang", "rollout.num_engines=3", "rollout.tp_size=4", "rollout.pp_size=2"]
    )
    assert cfg.rollout.gpus_per_engine == 8
    assert cfg.rollout.world_size == 24


def test_yaml_load_with_nested_sampling(tmp_path):
    path = write(
        tmp_path,
        """
rollout:
  model_path: /models/tiny
  num_engines: 2
  tp_size: 2
  server_extras: ["--mem-fraction-static", "0.5"]
  sampling:
    temperature: 0.7
    stop: ["</answer>"]
    stop_token_ids: [151643]
trainer:
  world_size: 4
ray:
  num_cpus: 8
""",
    )
    cfg = load_config(path, [])
    assert cfg.rollout.num_engines == 2 and cfg.rollout.tp_size == 2
    assert cfg.rollout.server_extras == ["--mem-fraction-static", "0.5"]
    assert cfg.rollout.sampling.temperature == 0.7
    assert cfg.rollout.sampling.stop == ["</answer>"] and cfg.rollout.sampling.stop_token_ids == [151643]
    assert cfg.rollout.sampling.top_p == 1.0  # unset keys keep defaults
    assert cfg.trainer.world_size == 4 and cfg.ray.num_cpus == 8


def test_empty_yaml_file_is_an_empty_config(tmp_path):
    cfg = load_config(write(tmp_path, ""), [MODEL])
    assert cfg.rollout.model_path == "/models/tiny"


def test_overrides_parse_yaml_values_and_beat_the_file(tmp_path):
    path = write(tmp_path, "rollout:\n  model_path: /models/tiny\n  tp_size: 4\n  sampling:\n    n: 8\n")
    cfg = load_config(
        path,
        [
            "rollout.tp_size=2",
            "rollout.use_gpu=true",
            "rollout.sampling.top_p=0.9",
            "rollout.sampling.stop_token_ids=[1, 2]",
            "rollout.sampling.stop=['a=b']",
            "rollout.api_key=secret",
            "ray.address=auto",
        ],
    )
    assert cfg.rollout.tp_size == 2 and cfg.rollout.use_gpu is True
    assert cfg.rollout.sampling.top_p == 0.9 and cfg.rollout.sampling.n == 8
    assert cfg.rollout.sampling.stop_token_ids == [1, 2] and cfg.rollout.sampling.stop == ["a=b"]
    assert cfg.rollout.api_key == "secret" and cfg.ray.address == "auto"


def test_override_into_a_section_the_yaml_left_null(tmp_path):
    path = write(tmp_path, "rollout:\n  model_path: m\n  sampling:\n")
    assert load_config(path, ["rollout.sampling.n=4"]).rollout.sampling.n == 4


def test_api_keys_not_in_repr():
    cfg = load_config(None, [MODEL, "rollout.api_key=hunter2", "rollout.admin_api_key=swordfish"])
    assert cfg.rollout.admin_api_key == "swordfish"
    assert "hunter2" not in repr(cfg) and "swordfish" not in repr(cfg)


# --- unknown keys ---------------------------------------------------------------------------


def test_unknown_override_key_names_it_and_lists_valid_keys():
    message = error_of(MODEL, "rollout.tensor_parallel=2")
    assert "'tensor_parallel'" in message
    assert "tp_size" in message and "num_engines" in message


def test_unknown_nested_override_key_lists_keys_at_that_level():
    message = error_of(MODEL, "rollout.sampling.temprature=0.5")
    assert "'temprature'" in message and "rollout.sampling" in message
    assert "temperature" in message and "top_p" in message
    assert "tp_size" not in message  # keys of the wrong level would mislead


def test_override_through_a_value_is_refused():
    assert "rollout.tp_size is a value, not a section" in error_of(MODEL, "rollout.tp_size.x=1")


def test_override_without_equals_is_refused():
    assert "key=value" in error_of("rollout.tp_size")


def test_unknown_yaml_key_names_path_and_valid_keys(tmp_path):
    path = write(tmp_path, "rollout:\n  model_path: m\n  sampling:\n    topp: 0.5\n")
    message = error_of(path=path)
    assert "rollout.sampling.topp=0.5: unknown key" in message
    assert "top_p" in message


def test_yaml_that_is_not_a_mapping(tmp_path):
    assert "list at the top level" in error_of(path=write(tmp_path, "- a\n- b\n"))


def test_invalid_yaml(tmp_path):
    assert "not valid YAML" in error_of(path=write(tmp_path, "rollout: [\n"))


# --- validation errors name field, value, fix ---------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.tp_size=0", "rollout.tp_size=0: must be >= 1"),
        ("rollout.num_engines=-2", "rollout.num_engines=-2: must be >= 1"),
        ("rollout.backend=vllm", "rollout.backend='vllm': must be 'embedded' or 'sglang'"),
        ("rollout.placement=shared", "rollout.placement='shared': must be 'colocated' or 'disaggregated'"),
        ("rollout.gpus_per_worker=1.5", "rollout.gpus_per_worker=1.5: must be <= 1"),
        ("rollout.startup_timeout_s=0", "rollout.startup_timeout_s=0: must be > 0"),
        ("rollout.sampling.temperature=-0.1", "rollout.sampling.temperature=-0.1: must be >= 0"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p=0: must be > 0"),
        ("rollout.sampling.top_p=1.1", "rollout.sampling.top_p=1.1: must be <= 1"),
        ("rollout.sampling.top_k=0", "rollout.sampling.top_k=0: must be -1 (off) or >= 1"),
        ("rollout.sampling.n=0", "rollout.sampling.n=0: must be >= 1"),
        ("rollout.sampling.max_new_tokens=-1", "rollout.sampling.max_new_tokens=-1: must be >= 0"),
        ("rollout.sampling.stop_token_ids=[1, x]", "rollout.sampling.stop_token_ids[1]='x'"),
        ("rollout.use_gpu=maybe", "rollout.use_gpu='maybe'"),
        ("trainer.world_size=0", "trainer.world_size=0: must be >= 1"),
        ("ray.num_gpus=-1", "ray.num_gpus=-1: must be >= 0"),
        # built in memory before anything starts: 10**12 digits hung `rollfleet train` there
        ("grpo.synthetic_digits=1000000000000", "grpo.synthetic_digits=1000000000000: must be <= 10000"),
        ("grpo.synthetic_prompts=10000000000", "grpo.synthetic_prompts=10000000000: must be <= 1000000"),
    ],
)
def test_each_error_names_field_value_and_fix(override, expected):
    message = error_of(MODEL, override)
    assert expected in message
    line = next(line for line in message.splitlines() if expected in line)
    assert "(fix: " in line


def test_all_problems_are_listed_together():
    error = pytest.raises(ConfigError, load_config, None, ["rollout.tp_size=0", "rollout.sampling.n=0"]).value
    assert len(error.problems) == 3
    assert any(p.startswith("rollout.model_path: is required") for p in error.problems)
    assert isinstance(error, ValueError)


def test_ep_size_must_divide_tp_size():
    message = error_of(MODEL, "rollout.tp_size=4", "rollout.ep_size=3")
    assert "rollout.ep_size=3: must divide tp_size=4" in message and "[1, 2, 4]" in message
    assert load_config(None, [MODEL, "rollout.tp_size=4", "rollout.ep_size=2"]).rollout.ep_size == 2


def test_pipeline_parallel_needs_sglang():
    message = error_of(MODEL, "rollout.pp_size=2")
    assert "rollout.pp_size=2" in message
    assert "the embedded engine has no pipeline parallel; use backend=sglang" in message
    assert load_config(None, [MODEL, "rollout.pp_size=2", "rollout.backend=sglang"]).rollout.pp_size == 2


def test_sequence_parallel_must_divide_trainer_world():
    message = error_of(MODEL, "trainer.world_size=4", "trainer.sequence_parallel_size=3")
    assert "trainer.sequence_parallel_size=3: must divide trainer.world_size=4" in message


COLOCATED = [MODEL, "rollout.placement=colocated", "trainer.world_size=2", "trainer.sequence_parallel_size=2"]


def test_sequence_parallel_rejected_with_colocated_rollout_tp():
    message = error_of(*COLOCATED, "rollout.tp_size=2")
    assert "trainer.sequence_parallel_size=2" in message and "tp_size*pp_size=2" in message
    assert "(fix: " in message


def test_sequence_parallel_rejected_with_colocated_rollout_pp():
    assert "trainer.sequence_parallel_size=2" in error_of(*COLOCATED, "rollout.pp_size=2", "rollout.backend=sglang")


def test_sequence_parallel_allowed_without_rollout_tp_or_when_disaggregated():
    assert load_config(None, [*COLOCATED, "rollout.num_engines=2"]).trainer.sequence_parallel_size == 2
    disaggregated = [*COLOCATED, "rollout.tp_size=2", "rollout.placement=disaggregated"]
    assert load_config(None, disaggregated).rollout.tp_size == 2


def test_colocated_needs_equal_trainer_and_rollout_worlds():
    message = error_of(MODEL, "rollout.placement=colocated", "rollout.num_engines=2", "trainer.world_size=4")
    assert "trainer.world_size=4: must equal the rollout world size" in message and "=2" in message


def test_ignored_gpu_fraction_warns():
    with pytest.warns(UserWarning, match="gpus_per_worker is ignored"):
        load_config(None, [MODEL, "rollout.gpus_per_worker=0.5"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, [MODEL, "rollout.gpus_per_worker=0.5", "rollout.use_gpu=true"])


# --- properties ----------------------------------------------------------------------------


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 3), st.sampled_from(["embedded", "sglang"]))
def test_rollout_accepted_iff_parallel_rules_hold(tp, ep, pp, backend):
    data = {"rollout": {"model_path": "m", "tp_size": tp, "ep_size": ep, "pp_size": pp, "backend": backend}}
    if tp % ep == 0 and (pp == 1 or backend == "sglang"):
        assert parse_config(data).rollout.world_size == tp * pp
    else:
        with pytest.raises(ConfigError):
            parse_config(data)


@settings(deadline=None, max_examples=100)
@given(
    temperature=st.floats(-2, 3, allow_nan=False),
    top_p=st.floats(-0.5, 1.5, allow_nan=False),
    top_k=st.integers(-3, 5),
    n=st.integers(-1, 3),
)
def test_sampling_accepted_iff_ranges_hold(temperature, top_p, top_k, n):
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "n": n}
    data = {"rollout": {"model_path": "m", "sampling": sampling}}
    if temperature >= 0 and 0 < top_p <= 1 and (top_k == -1 or top_k >= 1) and n >= 1:
        assert parse_config(data).rollout.sampling.top_k == top_k
    else:
        with pytest.raises(ConfigError):
            parse_config(data)


def test_run_config_is_the_loaded_type():
    assert isinstance(load_config(None, [MODEL]), RunConfig)


def test_verification_mode_follows_the_backend_and_fingerprints_are_refused_on_sglang():
    assert load_config(None, [MODEL]).verify_mode == "fingerprint"
    assert load_config(None, [MODEL, "rollout.backend=sglang"]).verify_mode == "version"
    assert (
        load_config(None, [MODEL, "weight_sync.transport=disk", "weight_sync.verify=version"]).verify_mode == "version"
    )
    message = error_of(MODEL, "rollout.backend=sglang", "weight_sync.transport=nccl", "weight_sync.verify=fingerprint")
    assert "weight_sync.verify" in message and "'fingerprint'" in message and "verify=version" in message


def test_sampling_is_seeded_where_the_engines_honour_the_seed():
    """auto: seeded on the embedded engine on CPU (not on a GPU, where seeds cost a decode step's time);
    on SGLang only with its deterministic inference (it ignores sampling_seed without it); an explicit
    choice the backend cannot keep is refused with the fix."""
    sglang, deterministic = "rollout.backend=sglang", "rollout.server_extras=[--enable-deterministic-inference]"
    assert load_config(None, [MODEL, "grpo.seed=7"]).sampling_seed == 7
    assert load_config(None, [MODEL, "rollout.use_gpu=true"]).sampling_seed is None
    assert load_config(None, [MODEL, "rollout.use_gpu=true", "grpo.seed_sampling=true"]).sampling_seed == 0
    assert load_config(None, [MODEL, "grpo.seed_sampling=false"]).sampling_seed is None
    assert load_config(None, [MODEL, sglang]).sampling_seed is None
    assert load_config(None, [MODEL, sglang, deterministic, "grpo.seed=3"]).sampling_seed == 3
    on_policy = "rollout.sglang_command=[python, -m, sglang.launch_server, --rl-on-policy-target=fsdp]"
    assert load_config(None, [MODEL, sglang, on_policy]).sampling_seed == 0
    assert load_config(None, [MODEL, sglang, deterministic, "grpo.seed_sampling=true"]).sampling_seed == 0
    message = error_of(MODEL, sglang, "grpo.seed_sampling=true")
    assert "grpo.seed_sampling=True" in message and "--enable-deterministic-inference" in message
    message = error_of(MODEL, sglang, deterministic, "grpo.seed_sampling=false", "rollout.sampling.n=8")
    assert "grpo.seed_sampling=False" in message and "seed 42" in message and "seed_sampling=auto" in message
    assert load_config(None, [MODEL, sglang, deterministic, "grpo.seed_sampling=false"]).sampling_seed is None  # n=1
    assert load_config(None, [MODEL]).rollout.seeds_each_sample is False
    assert load_config(None, [MODEL, sglang]).rollout.seeds_each_sample is True


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["grpo.environment=calculator"], ["grpo.environment='calculator'", "'package.module:Class'"]),
        (["grpo.environment=a.b:C", "train.routing_replay=true"], ["train.routing_replay=True", "grpo.environment"]),
        (
            ["grpo.environment=a.b:C", "grpo.agent.max_total_tokens=64", "rollout.sampling.max_new_tokens=64"],
            ["grpo.agent.max_total_tokens=64", "max_new_tokens"],
        ),
        (["grpo.environment=a.b:C", "grpo.agent.tool_timeout_s=0"], ["grpo.agent.tool_timeout_s=0", "> 0"]),
    ],
)
def test_agent_settings_name_field_value_and_fix(overrides, names):
    message = error_of("rollout.model_path=/m", *overrides)
    assert all(name in message for name in names), message


def test_environment_paths_that_do_not_import_say_which_part():
    from rollfleet.envs import load_environment

    with pytest.raises(ValueError, match="cannot import module .no_such_pkg.envs."):
        load_environment("no_such_pkg.envs:Calc")
    with pytest.raises(ValueError, match="has no class 'Nope' with a step"):
        load_environment("rollfleet.envs.calculator:Nope")
    assert load_environment("rollfleet.envs.calculator:Calculator").__name__ == "Calculator"
