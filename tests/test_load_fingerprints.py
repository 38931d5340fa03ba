"""Fingerprints an engine takes right after an update copied into its parameters answer verification
exactly as fingerprints computed afresh would, and are dropped when the weights change otherwise."""

from __future__ import annotations

from safetensors.torch import load_file

from rollfleet.engine.runner import ModelRunner
from rollfleet.wire.fingerprint import fingerprints


def expected(model_dir, dtype):
    return fingerprints(load_file(f"{model_dir}/model.safetensors").items(), dtype)


def fresh(runner: ModelRunner) -> dict[str, str]:
    runner._forget_load_prints()
    return runner.weights_fingerprint(None, 4096)


def test_load_fingerprints_answer_like_fresh_ones(qwen3_dir, qwen3_dir_b):
    runner = ModelRunner(qwen3_dir)
    runner.update_weights_from_disk(qwen3_dir_b)
    want = expected(qwen3_dir_b, runner.dtype)
    taken = runner._digests_taken_at_load()
    assert set(taken) == set(runner.plain_to_param)  # every unsharded plain parameter, tied ones included
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
    runner._update(lambda: ({name: new}, False))
    assert list(runner._digests_taken_at_load()) == [name]  # only what this update wrote
    prints = runner.weights_fingerprint(None, 4096)
    assert prints[name] == fingerprints([(name, new)], runner.dtype)[name]
    assert prints == fresh(runner)
    for _ in range(3 * len(runner.plain_to_param)):  # updates nobody verifies: samples stay bounded
        runner._update(lambda: ({name: new}, False))
    assert runner._load_prints.pending <= 2 * len(runner.plain_to_param)
    assert name in runner._digests_taken_at_load()
    runner.release_memory(["weights"])
    assert runner._digests_taken_at_load() == {}


def test_fused_experts_are_fingerprinted_from_the_parameters(moe_dir, moe_dir_b):
    runner = ModelRunner(moe_dir)
    runner.update_weights_from_disk(moe_dir_b)
    assert runner.weights_fingerprint(None, 4096) == expected(moe_dir_b, runner.dtype)
    fused = {name for name in runner.checkpoint_to_param if name not in runner.plain_to_param}
    assert any("experts" in name for name in fused) and not fused & set(runner._digests_taken_at_load())
