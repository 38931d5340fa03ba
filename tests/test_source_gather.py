"""ModuleSource on a real FSDP2 trainer (gloo, worlds 2 and 3 on loopback): the bucketed gather
gives exactly the checkpoint's tensors (uneven shards included), casts to the engines' dtype before
gathering, runs few collectives, and lets ranks that keep nothing take part. LoraSource on a LoRA
trainer likewise: its adapter's tensors, as one full_tensor() each gives them, in one collective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helper_processes import start_method
from safetensors.torch import load_file

from rollfleet.config.lora import LoraTrainConfig
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.sharding import init_distributed
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.gather import is_row_sharded
from rollfleet.weights.source import ModuleSource
from rollfleet.wire.fingerprint import fingerprints
from rollfleet.wire.net import free_port

GATHERED_DTYPES: list[torch.dtype] = []  # the dtype of each all-gather's input, as they pass


def _counted_gathers(run) -> tuple[object, int]:
    """`run()`'s result and how many all-gathers it made (the real collective, counted as it passes)."""
    real, calls = dist.all_gather_into_tensor, []

    def counting(output, input, *args, **kwargs):
        calls.append(1)
        GATHERED_DTYPES.append(input.dtype)
        return real(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        return run(), len(calls)
    finally:
        dist.all_gather_into_tensor = real


def _worker(rank: int, cases: list[tuple[int, int, str, str]]) -> None:
    """One process for every case (world, port, model dir, out) whose world includes its rank: each
    case is a default group of its own, made and destroyed in turn (one start of the processes for
    all cases)."""
    torch.set_num_threads(1)
    for world, port, model_dir, out in cases:
        if rank < world:
            init_distributed(rank, world, master_port=port, backend="gloo")
            try:
                _gather_case(rank, model_dir, out)
                dist.barrier()
            finally:
                dist.destroy_process_group()


def _gather_case(rank: int, model_dir: str, out: str) -> None:
    model = PolicyTrainer(model_dir, TrainConfig()).model
    result: dict = {"row_sharded": sum(is_row_sharded(p) for p in model.parameters())}
    for label, source in {
        "bucketed": ModuleSource(model),
        "per_layer": ModuleSource(model, gather_bytes=1),
        "bf16": ModuleSource(model, dtype=torch.bfloat16),
    }.items():
        GATHERED_DTYPES.clear()
        tensors, count = _counted_gathers(lambda s=source: {n: t.clone() for n, t in s.named_tensors()})
        result[label], result[f"{label}_gathers"] = tensors, count
        result[f"{label}_gathered_dtypes"] = set(GATHERED_DTYPES)
    uncast = ModuleSource(model, dtype=torch.bfloat16)  # as the tensor transport asks: it casts as it packs
    tensors, count = _counted_gathers(lambda: {n: t.clone() for n, t in uncast.named_tensors(cast=False)})
    result["uncast"], result["uncast_gathers"] = tensors, count
    left_out, count = _counted_gathers(lambda: list(ModuleSource(model, keep=rank == 0).named_tensors()))
    result["kept"], result["kept_gathers"] = len(left_out), count
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}
    peft_model = PolicyTrainer(model_dir, TrainConfig(lora=LoraTrainConfig(**lora))).model
    for param in peft_model.parameters():  # peft's B starts at zero: give every tensor values of its own
        if param.requires_grad:
            with torch.no_grad():
                param.to_local().normal_(generator=torch.Generator().manual_seed(param.numel() + rank))
    sources = {"lora": LoraSource(peft_model), "lora_kept": LoraSource(peft_model, keep=rank == 0)}
    for label, source in sources.items():
        tensors, count = _counted_gathers(lambda s=source: {n: t.clone() for n, t in s.named_tensors()})
        result[label], result[f"{label}_gathers"] = tensors, count
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    result["lora_each"] = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in state.items()}
    torch.save(result, Path(out) / f"rank{rank}.pt")


# world 3: every tiny dimension splits unevenly (64, 32, 16, 320 rows); MoE: fused experts, names by
# expert; world 1: the shards are the full tensors, never gathered
CASES = [("qwen3", 3), ("qwen3_moe", 2), ("qwen3", 1)]


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """Every case run by one start of as many processes as the largest world; case -> its directory."""
    dirs = {case: tmp_path_factory.mktemp(f"{case[0]}-world{case[1]}") for case in CASES}
    for (kind, _), path in dirs.items():
        make_tiny_model(path / kind, kind, seed=3)
    ports: list[int] = []
    while len(ports) < len(CASES):  # one store per case, made in turn: distinct ports
        port = free_port()
        if port not in ports:
            ports.append(port)
    cases = [(world, port, str(path / kind), str(path)) for ((kind, world), path), port in zip(dirs.items(), ports)]
    mp.start_processes(_worker, args=(cases,), nprocs=max(world for _, world in CASES), start_method=start_method())
    return dirs


@pytest.mark.parametrize(("kind", "world"), CASES)
def test_bucketed_gather_gives_the_checkpoint_exactly_in_few_collectives(kind, world, gathered):
    tmp_path = gathered[(kind, world)]
    model_dir = tmp_path / kind
    expected = load_file(model_dir / "model.safetensors")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    layers = 2  # tiny models: 2 decoder layers
    for result in ranks:
        assert result["row_sharded"] > 0
        for label in ("bucketed", "per_layer"):
            assert set(result[label]) == set(expected), label
            for name, tensor in expected.items():
                assert torch.equal(result[label][name], tensor), (label, name)
        # bucketed: every row shard of the tiny model in one collective; per layer: one per layer
        # plus one per parameter outside the layers (embeddings, final norm, lm_head)
        if world == 1:  # nothing to gather: no collective at all
            assert result["bucketed_gathers"] == result["per_layer_gathers"] == result["bf16_gathers"] == 0
        else:
            assert result["bucketed_gathers"] == 1
            assert result["per_layer_gathers"] == layers + 3
            assert result["bf16_gathered_dtypes"] == {torch.bfloat16}  # shards are cast before the gather
        for name, tensor in expected.items():
            assert result["bf16"][name].dtype == torch.bfloat16
            assert torch.equal(result["bf16"][name], tensor.to(torch.bfloat16)), name
        # cast=False: what needs no gather comes in the trainer's dtype (the pack casts it); gathered
        # shards are still cast before their gather
        assert result["uncast_gathers"] == result["bf16_gathers"]
        for name, tensor in expected.items():
            assert torch.equal(result["uncast"][name], tensor if world == 1 else tensor.to(torch.bfloat16)), name
        # the engine's fingerprints (values in its dtype) match what a bf16 push sends
        assert fingerprints(result["bf16"].items(), torch.bfloat16) == fingerprints(expected.items(), torch.bfloat16)
    assert [r["kept"] for r in ranks] == [len(expected)] + [0] * (world - 1)
    assert {r["kept_gathers"] for r in ranks} == {int(world > 1)}  # ranks that keep nothing still take part


def test_plain_module_is_cast_and_left_whole(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    got = dict(ModuleSource(model, dtype=torch.float16).named_tensors())
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert got[name].dtype == torch.float16 and torch.equal(got[name], param.detach().half())


def test_uncast_tensors_of_a_plain_module_are_its_parameters_for_the_pack_to_cast():
    from rollfleet.weights.transports.tensor import uncast_tensors

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    tensors, cast_to = uncast_tensors(ModuleSource(model, dtype=torch.float16))
    got = dict(tensors)
    assert cast_to == torch.float16
    for name, param in model.named_parameters():  # no copy: the pack reads the parameter itself
        assert got[name].dtype == torch.float32 and got[name].data_ptr() == param.data_ptr()
    tensors, cast_to = uncast_tensors(ModuleSource(model))  # no engine dtype: nothing to cast
    assert cast_to is None and all(t.dtype == torch.float32 for _, t in tensors)


def test_the_push_casts_only_to_the_one_dtype_every_engine_reports():
    from rollfleet.train.worker import engine_dtype
    from rollfleet.weights.transports import EngineTarget

    def targets(*dtypes):
        return [EngineTarget(i, "", num_ranks=1, rank_offset=1 + i, dtype=t) for i, t in enumerate(dtypes)]

    assert engine_dtype(targets(torch.bfloat16, torch.bfloat16)) == torch.bfloat16
    assert engine_dtype(targets(torch.bfloat16, torch.float32)) is None  # several: each engine casts on load
    assert engine_dtype(targets(torch.bfloat16, None)) is None  # one that does not say (SGLang)
    assert engine_dtype(targets(None)) is None


@pytest.mark.parametrize(("kind", "world"), CASES)
def test_the_adapter_is_gathered_in_one_collective_as_each_full_tensor_gives_it(kind, world, gathered):
    ranks = [torch.load(gathered[(kind, world)] / f"rank{r}.pt") for r in range(world)]
    for result in ranks:
        each = result["lora_each"]
        assert set(result["lora"]) == set(each) and len(each) >= 8, sorted(each)
        for name, tensor in each.items():
            assert torch.equal(result["lora"][name], tensor), name
        assert result["lora_gathers"] == int(world > 1), [r["lora_gathers"] for r in ranks]
    assert [len(r["lora_kept"]) for r in ranks] == [len(ranks[0]["lora_each"])] + [0] * (world - 1)
    assert {r["lora_kept_gathers"] for r in ranks} == {int(world > 1)}  # ranks that keep nothing take part
