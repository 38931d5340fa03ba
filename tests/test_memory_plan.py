"""The memory plan of a colocated GPU (rollfleet.fleet.memory_plan), on CPU with given GPU sizes:
the model's figures against models built here, the decisions `auto` takes, the refusals, and the
driver side (rollfleet.train.memory_setup) where nothing is planned."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2MoeConfig

from rollfleet.bench.shapes import REAL_VOCAB, qwen3_shape
from rollfleet.config import ConfigError, load_config
from rollfleet.fleet.memory_figures import ModelShape
from rollfleet.fleet.memory_plan import TRAINER_HEADROOM, plan_memory, unplanned
from rollfleet.tiny_models import tiny_config
from rollfleet.train.memory_setup import PLAN_FILE, plan_run, prompt_bound

GB = 10**9
H200, A100 = 141 * GB, 80 * GB
BENCH = {**qwen3_shape(2048, 24), "vocab_size": REAL_VOCAB, "model_type": "qwen3", "torch_dtype": "bfloat16"}
QWEN3_14B = {  # Qwen3-14B's sizes
    **{"hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 17408, "num_attention_heads": 40},
    **{"num_key_value_heads": 8, "head_dim": 128, "vocab_size": REAL_VOCAB, "model_type": "qwen3"},
}
COLOCATED = [
    "rollout.model_path=unused",
    "rollout.placement=colocated",
    "rollout.use_gpu=true",
    "rollout.gpus_per_worker=0.5",
    "weight_sync.transport=tensor",
]
SMALL_STEP = ["grpo.prompts_per_step=16", "rollout.sampling.n=8", "rollout.sampling.max_new_tokens=32"]
LARGE_STEP = [
    "grpo.prompts_per_step=64",
    "rollout.sampling.n=8",
    "rollout.sampling.max_new_tokens=512",
    "train.micro_batch_size=32",
]


def colocated(*overrides: str):
    return load_config(None, [*COLOCATED, *overrides])


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("qwen3"),
        tiny_config("qwen3", tie_word_embeddings=True),
        tiny_config("qwen3_moe"),
        tiny_config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[1], num_hidden_layers=4),
        Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
        Qwen2MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ],
    ids=["qwen3", "qwen3-tied", "qwen3-moe", "qwen3-moe-sparse", "qwen2-bias", "qwen2-moe-shared"],
)  # fmt: skip
def test_the_parameter_count_from_config_json_is_the_built_models(config):
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config.to_dict()).parameters() == sum(p.numel() for p in model.parameters())


def test_a_lora_adapters_count_is_peft_s():
    from peft import LoraConfig, get_peft_model

    config = tiny_config("qwen3")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_config(config.to_dict()).lora_parameters(8, targets) == trainable


def test_the_weights_an_adapters_targets_cover_are_the_models():
    config = tiny_config("qwen3")
    model = AutoModelForCausalLM.from_config(config)
    targets = ["q_proj", "v_proj", "down_proj", "lm_head", "embed_tokens"]
    covered = sum(m.weight.numel() for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets)
    assert ModelShape.from_config(config.to_dict()).lora_target_weights(targets) == covered


def test_the_bench_shape_keeps_everything_on_an_h200_for_both_steps():
    """2.08B bf16 on 141 GB: nothing moves at a turn, and the engine gets what the trainer leaves
    (the run measured on main died with the engines' default 0.85 beside a trainer)."""
    shape = ModelShape.from_config(BENCH)
    assert round(shape.parameters() / 1e9, 2) == 2.08
    for step in (SMALL_STEP, LARGE_STEP):
        plan = plan_memory(colocated(*step), shape, H200, prompt_tokens=64)
        assert not plan.release_weights and not plan.offload
        assert plan.trainer_turn_bytes <= H200 and plan.engine_turn_bytes <= H200
        assert plan.kv_pool_tokens >= plan.step_tokens
        # the trainer's parameters and Adam state (12 B a parameter) stay beside the engine's share
        assert plan.mem_fraction_static * H200 <= H200 - 12 * shape.parameters()
    large = plan_memory(colocated(*LARGE_STEP), shape, H200, prompt_tokens=64)
    assert (large.width, large.micro_batch_rows, large.logprob_chunk) == (576, 32, 1024)
    assert large.parts["trainer_peak"] > 30 * GB  # 32 x 576 tokens of 24 layers' activations


def test_a_14b_model_on_one_80gb_gpu_is_refused_with_its_figures_and_fixes():
    with pytest.raises(ConfigError) as refused:
        plan_memory(colocated(*SMALL_STEP), ModelShape.from_config(QWEN3_14B), A100, prompt_tokens=64)
    text = str(refused.value)
    for expected in ("GPU of 80.0 GB", "the trainer's turn needs", "parameters and optimizer state 177.2",
                     "gradients 59.1", "train.lora", "trainer.world_size higher", "nothing was started"):  # fmt: skip
        assert expected in text
    assert "micro_batch_size" not in text  # the state alone does not fit: a smaller micro batch cannot help


def test_auto_releases_the_engines_weights_when_only_that_makes_the_trainers_turn_fit():
    shape, gpu = ModelShape.from_config(BENCH), 48 * GB
    plan = plan_memory(colocated(*SMALL_STEP), shape, gpu, prompt_tokens=64)
    assert plan.release_weights and not plan.offload and plan.trainer_turn_bytes <= gpu
    with pytest.raises(ConfigError, match="engine weights kept 4.2 .*fix: .*rollout.release_weights=true"):
        plan_memory(colocated(*SMALL_STEP, "rollout.release_weights=false"), shape, gpu, prompt_tokens=64)


def test_auto_offloads_the_trainer_when_the_pool_could_not_hold_the_step_beside_it():
    shape, gpu = ModelShape.from_config(BENCH), 60 * GB
    step = ["grpo.prompts_per_step=16", "rollout.sampling.n=8", "rollout.sampling.max_new_tokens=4096"]
    plan = plan_memory(colocated(*step, "train.micro_batch_size=1"), shape, gpu, prompt_tokens=64)
    kept = plan_memory(colocated(*step, "train.micro_batch_size=1", "train.offload=false"), shape, gpu, 64)
    assert plan.offload and not plan.release_weights
    assert kept.kv_pool_tokens < plan.step_tokens <= plan.kv_pool_tokens
    assert kept.mem_fraction_static < plan.mem_fraction_static <= 0.85


def test_a_fraction_the_user_set_is_checked_not_replaced():
    shape = ModelShape.from_config(BENCH)
    plan = plan_memory(colocated(*SMALL_STEP, "rollout.mem_fraction_static=0.5"), shape, H200, 64)
    assert (plan.mem_fraction_static, plan.fraction_from) == (0.5, "rollout.mem_fraction_static")
    assert not plan.offload  # 0.5 leaves room for the trainer's state
    with pytest.raises(ConfigError) as refused:
        plan_memory(colocated(*SMALL_STEP, "rollout.mem_fraction_static=0.9", "train.offload=false"), shape, H200, 64)
    assert "rollout.mem_fraction_static lower than 0.9" in str(refused.value)
    assert "train.offload=true" in str(refused.value)
    with pytest.raises(ConfigError, match="mem_fraction_static higher than 0.02"):
        plan_memory(colocated(*SMALL_STEP, "rollout.mem_fraction_static=0.02"), shape, H200, 64)


def test_a_lora_run_keeps_its_base_weights_and_counts_only_its_adapter_as_trained():
    shape = ModelShape.from_config(BENCH)
    lora = ["weight_sync.transport=lora", "train.lora.rank=32", "weight_sync.max_lora_rank=32"]
    plan = plan_memory(colocated(*SMALL_STEP, *lora), shape, H200, 64)
    full = plan_memory(colocated(*SMALL_STEP), shape, H200, 64)
    assert not plan.release_weights
    adapter = shape.lora_parameters(32, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert plan.parts["trainer_gradients"] == 4 * adapter
    assert plan.parts["trainer_state"] == 12 * adapter + 4 * shape.parameters()  # the frozen base: fp32
    assert plan.parts["trainer_state"] < full.parts["trainer_state"]
    # the engine keeps a copy of each weight a merged adapter covers (bf16), inside its fraction
    assert plan.parts["engine_inside"] - full.parts["engine_inside"] == 2 * shape.lora_target_weights(
        ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


def test_the_plan_is_applied_as_booleans_and_a_fraction():
    cfg = colocated(*SMALL_STEP)
    assert (cfg.rollout.release_weights, cfg.train.offload) == ("auto", "auto")
    applied = plan_memory(cfg, ModelShape.from_config(BENCH), H200, 64).apply(cfg)
    assert applied.rollout.release_weights is False and applied.train.offload is False
    assert 0.5 < applied.rollout.mem_fraction_static <= 0.85


def test_unplanned_runs_keep_what_runs_did_before_the_plan(qwen3_dir, tmp_path):
    """CPU (the demo), disaggregated, or a fleet built as a library: release and offload; a LoRA run
    keeps its base weights. Nothing is written."""
    cpu = load_config("examples/cpu-demo.yaml", [f"rollout.model_path={qwen3_dir}"])
    resolved, plan = plan_run(cpu, tmp_path, ["copy:123="])
    assert plan is None and not (tmp_path / PLAN_FILE).exists()
    assert resolved.rollout.release_weights is True and resolved.train.offload is True
    assert resolved.rollout.mem_fraction_static is None
    auto = [f"rollout.model_path={qwen3_dir}", "rollout.release_weights=auto"]
    lora = load_config("examples/cpu-demo-lora.yaml", auto)  # a LoRA run's auto keeps them at config time
    assert lora.rollout.release_weights is False and unplanned(lora).rollout.release_weights is False
    set_by_user = load_config(
        None,
        ["rollout.model_path=x", "rollout.release_weights=false", "train.offload=false", "rollout.release_kv_cache=1"],
    )
    assert unplanned(set_by_user) is set_by_user


def test_the_prompt_bound_is_the_longest_prompts_token_count(qwen3_dir):
    from transformers import AutoTokenizer

    prompts = ["copy:1=", "copy:123456789012=", "x"]
    longest = max(len(AutoTokenizer.from_pretrained(qwen3_dir).encode(p)) for p in prompts)
    assert prompt_bound(str(qwen3_dir), prompts) == longest > 1
    assert prompt_bound(str(qwen3_dir), []) == 0


def test_the_plan_is_written_as_json_figures(tmp_path):
    plan = plan_memory(colocated(*SMALL_STEP), ModelShape.from_config(BENCH), H200, 64)
    figures = json.loads(json.dumps(plan.as_dict()))
    assert figures["gpu_gb"] == 141.0 and figures["parts_gb"]["engine_weights"] == pytest.approx(4.16, abs=0.01)
    assert figures["trainer_turn_gb"] <= 141.0 and figures["engine_turn_gb"] <= 141.0


def _trainer_figures(plan) -> int:
    return plan.parts["trainer_state"] + plan.parts["trainer_gradients"] + plan.parts["trainer_peak"]


def test_engines_keep_their_memory_through_the_turn_where_both_turns_fit_at_once():
    """The one-GPU example's step (64 x 8 x 512, micro batch 16) on an H200: the engine's share holds
    the step's samples at once beside the trainer's figures with their headroom, the trainer is capped
    at what the engine leaves, and nothing is released at a turn."""
    shape, cfg = ModelShape.from_config(BENCH), load_config("examples/gpu-1x.yaml")
    plan = plan_memory(cfg, shape, H200, prompt_tokens=16)
    assert not plan.release_kv_cache and not plan.release_weights and not plan.offload
    assert plan.kv_pool_tokens >= plan.step_tokens == 64 * 8 * 528
    assert plan.trainer_cap * H200 >= TRAINER_HEADROOM * _trainer_figures(plan)
    assert plan.mem_fraction_static + plan.trainer_cap <= 1 and plan.engine_turn_bytes <= H200
    applied = plan.apply(cfg)
    assert applied.rollout.release_kv_cache is False and applied.train.gpu_memory_cap == plan.trainer_cap
    assert plan.as_dict()["release_kv_cache"] is False and plan.as_dict()["trainer_cap"] == plan.trainer_cap


def test_the_engines_plan_for_the_steps_samples_so_a_small_step_keeps_its_kv_on_an_80gb_gpu():
    """The bench's 16 x 8 x 32 step on an H100 (85.02 GB as torch reads it): with the engines told to run
    the step's 128 samples at once, their logits reserve is 0.23 GB, not 7.5 (4096 requests), and the
    engine keeps its memory through the trainer's turn (released, the turn took 0.13-0.23 s of a 0.78 s
    step on 2026-12-06). A --max-running-requests the user gave is kept, and sizes the reserve."""
    shape, h100 = ModelShape.from_config(BENCH), 85_020_000_000
    cfg = colocated(*SMALL_STEP, "train.micro_batch_size=128")
    plan = plan_memory(cfg, shape, h100, prompt_tokens=6)
    assert plan.max_running_requests == 16 * 8 and not plan.release_kv_cache
    assert plan.kv_pool_tokens >= plan.step_tokens and plan.engine_turn_bytes <= h100
    assert plan.parts["engine_inside"] == 3 * 128 * REAL_VOCAB * 4 + 2 * 2**30
    extras = plan.apply(cfg).rollout.server_extras
    assert extras[-2:] == ["--max-running-requests", "128"]
    sglang = ["rollout.backend=sglang", 'rollout.sglang_command=["python3", "-m", "sglang.launch_server"]']
    on_sglang = plan_memory(colocated(*SMALL_STEP, *sglang), shape, h100, prompt_tokens=6)  # its memory is its own
    assert on_sglang.max_running_requests is None
    assert on_sglang.parts["engine_outside"] == 3 * 4096 * REAL_VOCAB * 4 + 2 * 2**30
    dynamic = colocated(*SMALL_STEP, "grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_extra=4")
    assert plan_memory(dynamic, shape, h100, prompt_tokens=6).max_running_requests == (16 + 4) * 8
    users = colocated(
        *SMALL_STEP, "train.micro_batch_size=128", 'rollout.server_extras=["--max-running-requests=4096"]'
    )
    theirs = plan_memory(users, shape, h100, prompt_tokens=6)
    assert theirs.max_running_requests is None and theirs.release_kv_cache  # 7.5 GB of reserve: no room to keep
    assert theirs.apply(users).rollout.server_extras == ["--max-running-requests=4096"]


def test_engines_release_as_before_where_the_trainers_turn_needs_their_memory():
    """A micro batch of 32 x 576 peaks at 65 GB: with its headroom beside an engine, the trainer would not
    fit; `auto` releases the KV pool for its turn and leaves the trainer uncapped. Asked for anyway, the
    run is refused with the figures."""
    shape = ModelShape.from_config(BENCH)
    plan = plan_memory(colocated(*LARGE_STEP), shape, H200, prompt_tokens=64)
    assert plan.release_kv_cache and plan.trainer_cap is None and not plan.offload
    assert plan.apply(colocated(*LARGE_STEP)).train.gpu_memory_cap is None
    # a fraction the user set is kept, and the trainer's turn does not fit in the 62.7 GB it leaves
    try:
        users = plan_memory(colocated(*LARGE_STEP, "rollout.mem_fraction_static=0.5"), shape, H200, prompt_tokens=64)
    except ConfigError as refused:  # auto must fall back to releasing, not refuse
        pytest.fail(f"auto refused a run that fits by releasing: {refused}")
    assert users.release_kv_cache and users.mem_fraction_static == 0.5
    with pytest.raises(ConfigError) as refused:
        plan_memory(colocated(*LARGE_STEP, "rollout.release_kv_cache=false"), shape, H200, prompt_tokens=64)
    text = str(refused.value)
    for expected in ("rollout.release_kv_cache=false keeps the engine's", f"x {TRAINER_HEADROOM} headroom",
                     "release_kv_cache=true", "train.micro_batch_size lower", "nothing was started"):  # fmt: skip
        assert expected in text
    forced = plan_memory(colocated(*SMALL_STEP, "rollout.release_kv_cache=true"), shape, H200, prompt_tokens=64)
    assert forced.release_kv_cache and forced.trainer_cap is None


def test_a_kept_kv_cache_keeps_the_weights_and_cpu_runs_release():
    kept = load_config(None, ["rollout.model_path=x", "rollout.release_kv_cache=false"])
    assert kept.rollout.release_weights is False
    with pytest.raises(ConfigError, match="rollout.release_weights.*release_kv_cache=false keeps all"):
        load_config(None, ["rollout.model_path=x", "rollout.release_kv_cache=false", "rollout.release_weights=true"])
    assert unplanned(load_config(None, ["rollout.model_path=x"])).rollout.release_kv_cache is True
    with pytest.raises(ConfigError, match="train.offload.*release_kv_cache=false keeps"):
        load_config(None, ["rollout.model_path=x", "rollout.release_kv_cache=false", "train.offload=true"])


def test_moves_the_user_asked_for_are_kept_over_a_kept_turn():
    shape = ModelShape.from_config(BENCH)
    for setting in ("train.offload=true", "rollout.release_weights=true"):
        plan = plan_memory(colocated(*SMALL_STEP, setting), shape, H200, prompt_tokens=64)
        assert plan.release_kv_cache and plan.trainer_cap is None
    assert plan_memory(colocated(*SMALL_STEP, "train.offload=true"), shape, H200, 64).offload
    assert plan_memory(colocated(*SMALL_STEP, "rollout.release_weights=true"), shape, H200, 64).release_weights


def test_the_one_gpu_example_loads_with_the_plans_defaults_and_fits_an_h200():
    cfg = load_config("examples/gpu-1x.yaml")
    assert cfg.rollout.placement == "colocated" and cfg.rollout.use_gpu and cfg.train.lora is None
    assert (cfg.rollout.release_weights, cfg.train.offload, cfg.rollout.mem_fraction_static) == ("auto", "auto", None)
    assert cfg.rollout.model_path.endswith("qwen3-h2048-l24-v151936")  # what the grpo-step bench writes
    plan = plan_memory(cfg, ModelShape.from_config(BENCH), H200, prompt_tokens=16)
    assert not plan.release_weights and not plan.offload


def test_a_refused_resume_is_told_in_the_runs_words():
    """An engine refused its resume after the trainer's turn (its device could not back it): the run's
    error says what the trainer kept and which settings give the engines less or free the trainer's GPU."""
    from rollfleet.fleet.colocation import refused_resume
    from rollfleet.wire.errors import RESUME_REFUSED

    engine = (
        f"resume_memory_occupation of tags ['cuda_graph', 'kv_cache'] {RESUME_REFUSED} 37.88 GiB on cuda:0 "
        "and 34.48 GiB is free there"
    )
    kept = {
        "allocated_before": 0,
        "reserved_before": 0,
        "allocated_after": 31.33 * 2**30,
        "reserved_after": 33.94 * 2**30,
    }
    message = refused_resume(engine, 0.64, kept)
    for part in [engine, "31.33 GiB allocated (33.94 GiB reserved)", "rollout.mem_fraction_static, 0.64 now",
                 "train.offload=true", "memory-plan.json"]:  # fmt: skip
        assert part in message, message
    assert "unset now" in refused_resume(engine, None, None) and "The trainer kept" not in refused_resume(
        engine, None, None
    )


@pytest.mark.parametrize(
    "kept_gib, word", [([23.34, 23.34, 23.34], "ok"), ([27.33, 27.33, 31.33], "LEAK"), ([23.3, 23.3, 24.5], "LEAK")]
)
def test_the_gpu_checks_tell_a_trainer_that_kept_more_than_its_state(tmp_path, kept_gib, word):
    """scripts/trainer_kept.py, which scripts/gpu_check_grpo.sh runs on each run's output: the figures of
    2026-12-06's H100 runs before (a sync's buckets held, then two) and after the fix."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "memory-plan.json").write_text(json.dumps({"parts_gb": {"trainer_state": 24.98}}))
    rows = [{"step": i + 1, "trainer_allocated_after_bytes": k * 2**30} for i, k in enumerate(kept_gib)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = Path(__file__).resolve().parents[1] / "scripts" / "trainer_kept.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.rstrip().endswith("ok") if word == "ok" else "LEAK" in out.stdout, out.stdout
