"""FSDP2 trainer over gloo on CPU, with real processes: world 2 trains exactly like world 1, and
save_hf / save_state / the weight source give back what the model holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helper_processes import start_method
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.sharding import init_distributed
from rollfleet.wire.net import free_port


def make_batch(seed: int = 0, count: int = 7) -> list[dict]:
    """Odd size and ragged lengths: rank 1 of 2 gets a padding micro-batch."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for index in range(count):
        prompt = torch.randint(3, 300, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(3, 300, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        batch.append(
            {
                "prompt_ids": prompt,
                "output_ids": output,
                "logprobs": (torch.randn(len(output), generator=g) * 0.1 - 5.8).tolist(),
                "advantage": float(index % 3 - 1),
            }
        )
    return batch


def full_weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.weight_source().named_tensors()}


def _worker(rank: int, world_size: int, port: int, scenario: str, model_dirs: list, out_dir: str, mbs: int) -> None:
    """One rank: `scenario` on model_dirs[0]; "all+moe" then goes on to "moe" on model_dirs[1] in the
    same group (two independent cases, one start of the ranks)."""
    init_distributed(rank, world_size, master_port=port, backend="gloo")
    torch.set_num_threads(1)
    try:
        out = Path(out_dir)
        config = TrainConfig(lr=1e-2, micro_batch_size=mbs, clip_high=0.28, grad_clip=0.5)
        result = _scenario(PolicyTrainer(model_dirs[0], config), scenario.split("+")[0], out)
        if scenario.endswith("+moe"):
            result["moe"] = _scenario(PolicyTrainer(model_dirs[1], config), "moe", out / "moe")
        if rank == 0:
            torch.save(result, out / "result.pt")
        dist.barrier()  # leave together: a rank that tears gloo down early can abort its peer
    finally:
        dist.destroy_process_group()


def _scenario(trainer: PolicyTrainer, scenario: str, out: Path) -> dict:
    result: dict = {}
    if scenario in ("step", "all"):
        result["before"] = full_weights(trainer)
        result["metrics"] = trainer.train_step(make_batch(0))
        result["after"] = full_weights(trainer)
    if scenario == "all":
        trainer.save_hf(out / "hf")
        trainer.save_state(out / "state", extra={"data_step": 1})
        result["metrics2"] = trainer.train_step(make_batch(1))
        result["after2"] = full_weights(trainer)
        result["extra"] = trainer.load_state(out / "state")
        result["loaded_step"] = trainer.step
        result["reloaded"] = full_weights(trainer)
        result["metrics2_again"] = trainer.train_step(make_batch(1))
        result["after2_again"] = full_weights(trainer)
    if scenario == "moe":
        trainer.train_step(make_batch(0))
        trainer.save_hf(out / "hf", max_shard_bytes=100_000)  # several shards + index
        result["after"] = full_weights(trainer)
    return result


def run_ranks(world_size: int, scenario: str, model_dirs: list[str], out_dir: Path, mbs: int = 2) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _worker,
        args=(world_size, free_port(), scenario, model_dirs, str(out_dir), mbs),
        nprocs=world_size,
        start_method=start_method(),
    )
    return torch.load(out_dir / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    model_dir = str(make_tiny_model(root / "model", "qwen3", seed=0))
    moe_dir = str(make_tiny_model(root / "moe", "qwen3_moe", seed=0))
    one = run_ranks(1, "step", [model_dir], root / "world1", mbs=3)
    two = run_ranks(2, "all+moe", [model_dir, moe_dir], root / "world2", mbs=2)
    return model_dir, root, one, two


def test_world2_step_equals_world1(runs):
    _, _, one, two = runs
    changed = 0.0
    for name, before in one["before"].items():
        assert torch.equal(before, two["before"][name])
        assert torch.allclose(one["after"][name], two["after"][name], atol=1e-5, rtol=0), name
        changed = max(changed, float((one["after"][name] - before).abs().max()))
    assert changed > 1e-3  # the step really moved the weights
    keys = ("loss", "grad_norm", "clip_frac", "ratio_mean", "logprob_mismatch_mean", "logprob_mismatch_max")
    for key in (*keys, "tis_ratio_mean", "tis_ratio_max", "tis_truncated_share"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], abs=1e-5), key
    assert one["metrics"]["tokens"] == two["metrics"]["tokens"] == sum(len(i["output_ids"]) for i in make_batch(0))


def test_save_hf_reloads_with_transformers(runs):
    model_dir, root, _, two = runs
    hf = root / "world2" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    state = model.state_dict()
    assert set(state) == set(two["after"])
    for name, tensor in two["after"].items():
        assert torch.equal(state[name], tensor), name
    saved_keys = set(load_file(hf / "model.safetensors"))
    assert saved_keys == set(two["after"]) == set(load_file(Path(model_dir) / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert (
        tokenizer("the quick brown fox")["input_ids"]
        == AutoTokenizer.from_pretrained(model_dir)("the quick brown fox")["input_ids"]
    )
    assert (hf / "generation_config.json").is_file()


def test_save_state_load_state_round_trip(runs):
    _, _, _, two = runs
    assert two["extra"] == {"data_step": 1} and two["loaded_step"] == 1
    for name, tensor in two["after"].items():
        assert torch.equal(two["reloaded"][name], tensor), name
    # the same second step after the restore: the optimizer moments came back too
    for name, tensor in two["after2"].items():
        assert torch.equal(two["after2_again"][name], tensor), name
    assert two["metrics2_again"]["loss"] == two["metrics2"]["loss"]
    assert two["metrics2_again"]["step"] == two["metrics2"]["step"] == 2


def test_moe_weight_source_uses_checkpoint_names_and_shards(runs):
    _, root, _, two = runs
    model_dir, result = root / "moe", two["moe"]  # trained by the world-2 ranks after their dense case
    hf = root / "world2" / "moe" / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    saved = {}
    for shard in shards:
        saved.update(load_file(hf / shard))
    assert set(saved) == set(result["after"]) == set(load_file(model_dir / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved  # per expert, not fused
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reloaded = {name: tensor for name, tensor in model.state_dict().items() if ".experts." not in name}
    for name, tensor in reloaded.items():
        assert torch.equal(tensor, result["after"][name]), name


def test_refusals_name_the_fix(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model")
    with pytest.raises(ValueError, match="mixed_precision='bf16' needs a GPU"):
        PolicyTrainer(model_dir, TrainConfig(mixed_precision="bf16"), device="cpu")
    with pytest.raises(RuntimeError, match="init_distributed"):
        PolicyTrainer(model_dir, device="cpu")
    with pytest.raises(ValueError, match="extra_forbidden|Extra inputs"):
        TrainConfig(learning_rate=1e-3)
