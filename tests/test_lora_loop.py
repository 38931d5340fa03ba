"""LoRA GRPO end to end on real engines and Ray: the loop trains an adapter and pushes only it, each
step a new named version verified on every engine; an engine that lacks the adapter fails the sync
and is never asked for a sample; a dead engine's place goes to a standby holding the base weights,
which gets the current adapter before it serves; a resumed run continues the adapter."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_grpo_loop import Recorder, metrics_rows, run_config
from test_lora import GREEDY, PROMPTS, make_adapter

from rollfleet.config import load_config
from rollfleet.fleet.fleet import Fleet, WeightSyncError
from rollfleet.train.loop import train
from rollfleet.weights.adapter import LoraSource
from rollfleet.wire.client import EngineError

pytestmark = pytest.mark.usefixtures("local_ray")
TARGETS = ["q_proj", "v_proj", "lm_head", "embed_tokens"]
LORA = ("weight_sync.transport=lora", "train.lora.rank=4", "train.lora.alpha=8", "weight_sync.max_lora_rank=8")
ADAPTER_TENSORS = 2 * 2 * 2 + 2 + 2  # A and B of q_proj and v_proj in 2 layers, of lm_head and of embed_tokens


def lora_run(model_dir, out, *overrides):
    return run_config(
        model_dir,
        out,
        *LORA,
        f"train.lora.target_modules=[{','.join(TARGETS)}]",
        f"weight_sync.path={out}/adapters",
        "train.lr=0.02",
        *overrides,
    )


def test_lora_grpo_run_pushes_only_the_adapter_and_resume_continues_it(qwen3_dir, tmp_path):
    cfg, temp = lora_run(qwen3_dir, tmp_path, "rollout.num_engines=2", "grpo.steps=2")
    recorder = Recorder(qwen3_dir)
    try:
        train(cfg, observe=recorder)
        rows = metrics_rows(tmp_path)
        for step, row in enumerate(rows):
            # step 0 serves the base model as loaded (the fresh adapter is the base); then the pushed adapter
            recorder.check(step, 4, str(step) if step else "default", engines={0, 1})
            assert row["sync_tensors"] == ADAPTER_TENSORS and row["sync_verified_engines"] == 2
        # the engines sampled from the adapter: the trainer's logprobs (with the adapter) match theirs
        assert all(r["train/logprob_mismatch_mean"] < 1e-3 for r in rows)
        saved = load_file(tmp_path / "checkpoints" / "adapter-step-2" / "adapter_model.safetensors")
        pushed = load_file(tmp_path / "adapters" / "version-2" / "adapter_model.safetensors")
        assert len(saved) == ADAPTER_TENSORS and all(torch.equal(saved[k], pushed[k]) for k in saved)
        # it trained: the factors peft starts at 0 (B of a linear target, A of the embedding) moved
        assert all(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k or "lora_embedding_A" in k)
        shutil.rmtree(tmp_path / "adapters" / "version-2")  # the resumed run must push it again, from its state
        cfg, temp2 = lora_run(qwen3_dir, tmp_path, "rollout.num_engines=2", "grpo.steps=3")
        recorder = Recorder(qwen3_dir)
        train(cfg, resume=True, observe=recorder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    shutil.rmtree(temp2, ignore_errors=True)
    resumed = load_file(tmp_path / "adapters" / "version-2" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], saved[k]) for k in saved)  # what it pushed before its first step
    assert sorted(recorder.steps) == [2]
    recorder.check(2, 4, "2", engines={0, 1})
    assert metrics_rows(tmp_path)[-1]["train/logprob_mismatch_mean"] < 1e-3
    assert (tmp_path / "checkpoints" / "adapter-step-3" / "adapter_config.json").is_file()


def test_missing_adapter_fails_the_sync_and_a_standby_takes_the_place_with_it(qwen3_dir, tmp_path):
    cfg = load_config(
        None,
        [
            f"rollout.model_path={qwen3_dir}",
            f"rollout.log_dir={tmp_path}",
            "rollout.num_engines=2",
            "rollout.standby_engines=1",
            "rollout.auto_restart=false",
            *LORA,
            f"weight_sync.path={tmp_path / 'adapters'}",
        ],
    )
    peft_model = make_adapter(qwen3_dir, TARGETS[:2])
    fleet = Fleet.from_config(cfg)
    try:
        base = [s.output_ids for s in fleet.generate(PROMPTS, sampling=GREEDY)]
        report = fleet.sync_weights(LoraSource(peft_model), "1")
        assert report.verified == [0, 1] and fleet.lora_name == "policy-v1"
        want = [s.output_ids for s in fleet.generate(PROMPTS, n=4, sampling=GREEDY)]
        assert want != [b for b in base for _ in range(4)]
        # engine 1 loses the adapter: asked for it, it refuses (never a base-model sample), and verification fails it
        fleet.pool.on_all("unload_lora_adapter", [1], "policy-v1")
        with pytest.raises(EngineError, match="policy-v1"):
            fleet.pool.on_all("generate", [1], input_ids=PROMPTS, sampling_params=GREEDY, lora_path="policy-v1")
        with pytest.raises(WeightSyncError, match="engine 1: adapter 'policy-v1'"):
            fleet.verify(report)
        assert fleet.slots[1].state.value == "INACTIVE"
        samples = fleet.generate(PROMPTS, n=4, sampling=GREEDY)
        assert {s.engine_id for s in samples} == {0} and [s.output_ids for s in samples] == want
        # the standby (base weights from the model path) takes engine 1's place and gets the adapter first
        fleet.restart_inactive()
        serving = [s for s in fleet.slots if not s.standby]  # the standby swapped places with engine 1
        assert [s.engine_id for s in serving] == [0, 2] and all(s.state.value == "ACTIVE" for s in serving)
        assert serving[1].lifecycle.history[-1].why.endswith("verified at version '1' (adapter)")
        samples = fleet.generate(PROMPTS, n=8, sampling=GREEDY)
        assert {s.engine_id for s in samples} == {0, 2}
        assert [s.output_ids for s in samples][::2] == want
        loaded = fleet.pool.on_all("loaded_lora_adapters", [0, 2])
        assert [list(a) for a in loaded] == [["policy-v1"], ["policy-v1"]]
    finally:
        fleet.shutdown()
