"""train.compile: each decoder layer's forward compiled (rollfleet.train.sharding.compiled_forwards) trains
as the eager trainer does, under the same parameter names, through micro-batches of changing shapes. On
the CPU with dynamo's aot_eager backend (the same graphs and autograd, no code generation): one rank of
a real gloo group, in its own process (dynamo's configuration is the process's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helper_processes import start_method
from test_trainer import full_weights, make_batch

from rollfleet.config import load_config
from rollfleet.config.lora import LoraTrainConfig
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train import sharding
from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.sharding import init_distributed
from rollfleet.wire.net import free_port

CASES = ("full", "lora+kl")


def _worker(index: int, ports: list[int], model_dir: str, out: str) -> None:
    """Case CASES[index], eager and compiled, as the one rank of a gloo group of its own (the two
    cases run side by side, one process each: dynamo's tracing is single-threaded)."""
    case = CASES[index]
    init_distributed(0, 1, master_port=ports[index], backend="gloo")
    torch.set_num_threads(1)
    sharding.COMPILE_BACKEND = "aot_eager"
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # past the limit dynamo would run eagerly, silently
    lora = LoraTrainConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    options = {"full": {}, "lora+kl": {"lora": lora, "kl_coef": 0.1}}[case]
    try:
        result = {}
        for compiled in (False, True):
            config = TrainConfig(lr=1e-2, micro_batch_size=3, compile=compiled, **options)
            trainer = PolicyTrainer(model_dir, config)
            steps = [trainer.train_step(make_batch(seed, count=7)) for seed in (0, 1)]  # ragged widths
            result[compiled] = {"steps": steps, "weights": full_weights(trainer)}
        result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.save(result, Path(out) / f"result-{index}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    # one decoder layer (the test model's two took 35-44 s of tracing here, the suite's slowest setup);
    # how many variants 24 layers compile, against dynamo's limit, is the GPU compile round's to show
    model_dir = str(make_tiny_model(root / "model", "qwen3", seed=0, num_hidden_layers=1))
    ports: list[int] = []
    while len(ports) < len(CASES):  # distinct: each case's group has a store of its own
        ports += [port for port in [free_port()] if port not in ports]
    mp.start_processes(_worker, args=(ports, model_dir, str(root)), nprocs=len(CASES), start_method=start_method())
    return {case: torch.load(root / f"result-{index}.pt") for index, case in enumerate(CASES)}


@pytest.mark.parametrize("case", ["full", "lora+kl"])
def test_compiled_layers_train_as_the_eager_ones_under_the_same_names(result, case):
    """Full weights, and a LoRA run with a KL reference (the adapter disabled: another guard for each
    layer), each with and without grad (the old log-probs), over two shapes: within dynamo's limit."""
    eager, compiled = result[case][False], result[case][True]
    assert result[case]["graphs"] > 0  # dynamo captured the layers' forwards
    assert list(compiled["weights"]) == list(eager["weights"])  # the checkpoint's names, no `_orig_mod.`
    for name, tensor in eager["weights"].items():
        assert torch.allclose(compiled["weights"][name], tensor, atol=1e-5, rtol=1e-4), name
    for ours, theirs in zip(compiled["steps"], eager["steps"], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_compile_is_refused_with_routing_replay():
    with pytest.raises(Exception, match=r"train.compile=True: cannot be combined with train.routing_replay"):
        load_config(None, ["rollout.model_path=x", "train.compile=true", "train.routing_replay=true"])
