"""Fingerprints an engine takes right after an update copied into its parameters answer verification
exactly as fingerprints computed afresh would, and are dropped when the weights change otherwise."""

from __future__ import annotations

from safetensors.torch import load_file

from rollfleet.engine.model.model import ModelRunner
from rollfleet.wire.fingerprint import fingerprints


def expected(model_dir, dtype):
    return fingerprints(load_file(f"{model_dir}/model.safetensors").items(), dtype)


def fresh(runner: ModelRunner) -> dict[str, str]:
    runner.load_prints.forget()
    return runner.weights_fingerprint(None, 4096)


def test_load_fingerprints_answer_like_fresh_ones(qwen3_dir, qwen3_dir_b):
    runner = ModelRunner(qwen3_dir)
    runner.weights.from_disk(qwen3_dir_b)
    want = expected(qwen3_dir_b, runner.dtype)
    taken = runner.load_prints.digests()
    assert set(taken) == set(runner.schema.plain_to_param)  # every unsharded plain parameter, tied ones included
    assert taken == {name: want[name] for name in taken}
    assert runner.weights_fingerprint(None, 4096) == want
    assert runner.weights_fingerprint(None, 128) == fingerprints(
        load_file(f"{qwen3_dir_b}/model.safetensors").items(), runner.dtype, samples=128
    )
    assert fresh(runner) == want


def test_load_fingerprints_follow_later_updates_and_go_with_released_weights(qwen3_dir, qwen3_dir_b):
    runner = ModelRunner(qwen3_dir)
    assert runner.weights_fingerprint(None, 4096) == expected(qwen3_dir, runner.dtype)  # none taken yet
    name = "model.layers.1.mlp.down_proj.weight"
    new = load_file(f"{qwen3_dir_b}/model.safetensors")[name]
    runner.weights.apply(lambda: ({name: new}, False))
    assert list(runner.load_prints.digests()) == [name]  # only what this update wrote
    prints = runner.weights_fingerprint(None, 4096)
    assert prints[name] == fingerprints([(name, new)], runner.dtype)[name]
    assert prints == fresh(runner)
    for _ in range(3 * len(runner.schema.plain_to_param)):  # updates nobody verifies: samples stay bounded
        runner.weights.apply(lambda: ({name: new}, False))
    assert runner.load_prints.pending <= 2 * len(runner.schema.plain_to_param)
    assert name in runner.load_prints.digests()
    runner.release_memory(["weights"])
    assert runner.load_prints.digests() == {}


def test_fused_experts_are_fingerprinted_from_the_parameters(moe_dir, moe_dir_b):
    runner = ModelRunner(moe_dir)
    runner.weights.from_disk(moe_dir_b)
    assert runner.weights_fingerprint(None, 4096) == expected(moe_dir_b, runner.dtype)
    fused = {name for name in runner.schema.checkpoint_to_param if name not in runner.schema.plain_to_param}
    assert any("experts" in name for name in fused) and not fused & set(runner.load_prints.digests())
