"""What a LoRA version costs the embedded engine on a GPU, beside the arithmetic it replaced, in one run:

    python scripts/gpu_bench_lora_merge.py        (one GPU; prints JSON lines, also to $OUT/lora-merge.json)

The benches' 2.08B Qwen3 shape in bf16 on the GPU, a rank-32 adapter on every linear layer (168
targets, 68 MB in bf16) arriving as views of one bucket on the GPU, as the lora transport sends it:
- load: the host copy the engine keeps (`host_copies`: pinned now) against the pageable copy it made
  before;
- merge: `LoraMerge.use` of a new version (restore the last one's targets, save, merge), against the
  loop it replaced (each target's halves copied to the device apart, three float32 temporaries of
  [out, in]), with a check that both give the same weights bit for bit;
- merge after a colocated turn: the same, the allocator's cache emptied before each (the engine's
  release does it at every turn), against the merge of db7133d (a saved copy and a float32 delta
  allocated per target: 168 device allocations each time, where the merge now makes two); then with
  float32 adapters (135 MB), as the GRPO loop's trainer sends them.
Medians of 5 after a warm-up, the device's work waited for.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")

from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from rollfleet.bench.shapes import REAL_VOCAB, qwen3_shape  # noqa: E402
from rollfleet.engine.lora.host_copies import host_copies  # noqa: E402
from rollfleet.engine.lora.lora import LoraLimits, parse_adapter  # noqa: E402
from rollfleet.engine.lora.lora_merge import LoraMerge  # noqa: E402
from rollfleet.engine.tp.ranks import Ranks  # noqa: E402
from rollfleet.engine.tp.shards import local_of  # noqa: E402

RANK, LINEAR = 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINES: list[dict] = []


def say(**line) -> None:
    LINES.append(line)
    print(json.dumps(line), flush=True)


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of `fn` after one warm-up, the device waited for."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def bucket_adapter(model, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """peft-named A and B of every linear target, as views of one buffer of `dtype` on the GPU."""
    shapes = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR:
            out_features, in_features = module.weight.shape
            shapes[f"base_model.model.{name}.lora_A.weight"] = (RANK, in_features)
            shapes[f"base_model.model.{name}.lora_B.weight"] = (out_features, RANK)
    total = sum(a * b for a, b in shapes.values())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    flat = torch.randn(total, generator=gen, device="cuda", dtype=torch.float32).mul_(0.01).to(dtype)
    tensors, at = {}, 0
    for key, (a, b) in shapes.items():
        tensors[key] = flat[at : at + a * b].view(a, b)
        at += a * b
    return tensors


@torch.no_grad()
def old_use(merge: LoraMerge, name: str) -> None:
    """The merge as it was before (kept here to measure against): per target, its halves copied to
    the device one by one, then W = (W.float() + (B @ A) * scale).to(W.dtype)."""
    params = merge.base_params()
    for target in merge.adapters[name].targets:
        local = local_of(params[f"{target.module}.weight"])
        merge._saved.append((local, local.clone()))
        delta = (target.lora_b.to(local.device, torch.float32) @ target.lora_a.to(local.device, torch.float32)) * (
            target.scale
        )
        local.copy_((local.float() + delta).to(local.dtype))
    merge.active = name


@torch.no_grad()
def per_target_use(merge: LoraMerge, name: str) -> None:
    """The merge of db7133d: the same arithmetic as `LoraMerge.use`, a saved copy and a float32 delta
    allocated per target."""
    params = merge.base_params()
    for target in merge.adapters[name].targets:
        local = local_of(params[f"{target.module}.weight"])
        merge._saved.append((local, local.clone()))
        local.copy_(target.delta(local.device).add_(local))
    merge.active = name


def after_a_turn(merge: LoraMerge, use, names: tuple[str, str] = ("v0", "v1")) -> float:
    """ms of `use` of a new version, each time after the adapter's unmerge and an emptied cache."""

    def once(name: str) -> None:
        merge.base_params()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        began = time.perf_counter()
        use(name)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)

    times: list[float] = []
    for _ in range(3):
        once(names[0]), once(names[1])
    return statistics.median(times[2:])


def main() -> None:
    config = Qwen3Config(**qwen3_shape(2048, 24), vocab_size=REAL_VOCAB, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    params = dict(model.named_parameters())
    merge = LoraMerge(model, params, LoraLimits(max_rank=RANK), Ranks(None), on_merge=lambda: None)
    config_dict = {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(LINEAR), "peft_type": "LORA"}
    buckets = [bucket_adapter(model, seed) for seed in (1, 2)]
    nbytes = sum(t.numel() * t.element_size() for t in buckets[0].values())

    def pageable_copy():  # what host_copies made before: one pageable copy of the bucket's span
        first = next(iter(buckets[0].values()))
        storage = torch.empty(0, dtype=torch.uint8, device="cuda").set_(first.untyped_storage())
        storage.to("cpu", copy=True)

    say(
        what="load host copy",
        bytes=nbytes,
        pageable_ms=timed(pageable_copy),
        pinned_ms=timed(lambda: host_copies(buckets[0])),
    )
    for index, tensors in enumerate(buckets):
        name = f"v{index}"
        merge.adapters[name] = parse_adapter(
            name, "__tensor__", config_dict, tensors, model, merge.targetable, merge.limits
        )
    targets = len(merge.adapters["v0"].targets)

    def alternate(use):
        for name in ("v0", "v1"):
            use(name)

    new_ms = timed(lambda: alternate(merge.use)) / 2
    old_ms = timed(lambda: alternate(lambda name: old_use(merge, name))) / 2
    merge.use("v1")
    new = {name: local_of(params[name]).clone() for name in params}
    merge.base_params()
    old_use(merge, "v1")
    same = all(torch.equal(new[name], local_of(params[name])) for name in params)
    merge.base_params()
    say(
        what="merge of a new version",
        targets=targets,
        new_ms=new_ms,
        old_ms=old_ms,
        old_over_new=old_ms / new_ms,
        same_weights=same,
    )
    say(
        what="merge after a colocated turn (cache emptied)",
        targets=targets,
        new_ms=after_a_turn(merge, merge.use),
        per_target_ms=after_a_turn(merge, lambda name: per_target_use(merge, name)),
    )
    for index in (0, 1):  # float32 adapters, as a trainer's LoRA parameters are (the GRPO loop's)
        merge.adapters[f"f{index}"] = parse_adapter(
            f"f{index}",
            "__tensor__",
            config_dict,
            bucket_adapter(model, 3 + index, torch.float32),
            model,
            merge.targetable,
            merge.limits,
        )
    say(
        what="merge after a colocated turn (cache emptied), float32 adapters",
        targets=targets,
        new_ms=after_a_turn(merge, merge.use, ("f0", "f1")),
        per_target_ms=after_a_turn(merge, lambda name: per_target_use(merge, name), ("f0", "f1")),
    )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "lora-merge.json"), "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "lines": LINES}, out, indent=1)
    assert same, "the merge's weights differ from the arithmetic it replaced"


if __name__ == "__main__":
    main()
