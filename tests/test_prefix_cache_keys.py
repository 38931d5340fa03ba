"""The prefix cache reuses a page only under what made its KV: the same base weights and the same
LoRA adapter (a load of it: one reloaded under its name is another). On a real server with pages of
4 tokens and a prompt of 14 tokens (3 full pages a repeat may start from), with no flush between
requests: greedy tokens equal a cold run of each (flush_cache, then the same request), and
`cached_tokens` says when pages were reused."""

from __future__ import annotations

import pytest
from conftest import call, client_for, engine_server, held_in_flight, reference_greedy, run
from test_lora import DENSE_TARGETS, LORA_FLAGS, make_adapter

from rollfleet.weights.adapter import LoraSource, save_adapter
from rollfleet.wire.net import free_port

PROMPT = [40, 3, 41, 5, 42, 7, 43, 9, 44, 11, 45, 13, 46, 15]  # 14 tokens: 3 full pages of 4
REUSED = 12  # the pages a repeat starts from (its last prompt token is always computed: its logits)
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TIMEOUT = ["--rollfleet-remote-instance-timeout-s", "20"]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    extra = [*LORA_FLAGS, "--max-loaded-loras", "4", "--page-size", "4", *TIMEOUT]
    with engine_server(qwen3_dir, tmp_path_factory.mktemp("prefix-keys"), extra=extra) as proc:
        yield proc
        # every test leaves the server at qwen3_dir's weights with no adapter loaded


@pytest.fixture(scope="module")
def adapter_dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    """Two peft adapters of other weights, saved as directories ("a", "b")."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, name in enumerate(("a", "b")):
        source = LoraSource(make_adapter(qwen3_dir, DENSE_TARGETS, seed=seed))
        dirs[name] = str(save_adapter(source.named_tensors(), source.config_dict(), root / name))
    return dirs


def ask(server, lora: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT (under adapter `lora`) and how many prompt tokens came from cached pages."""
    out = call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY, lora_path=lora)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def cold(server, lora: str | None = None) -> list[int]:
    """PROMPT's greedy tokens from an empty cache."""
    call(server, "flush_cache")
    tokens, cached = ask(server, lora)
    assert cached == 0
    return tokens


def unload_all(server) -> None:
    for name in call(server, "get_model_info")["loaded_lora_adapters"]:
        call(server, "unload_lora_adapter", name)


def test_base_and_adapters_interleaved_never_share_pages(server, adapter_dirs):
    for name, directory in adapter_dirs.items():
        call(server, "load_lora_adapter", name, directory)
    try:
        want = {name: cold(server, name) for name in (None, "a", "b")}
        assert len({tuple(tokens) for tokens in want.values()}) == 3  # each one's KV differs: a wrong page shows
        call(server, "flush_cache")
        seen = set()
        for name in (None, "a", "b", "a", None, "b", None, "a"):  # no control call between them
            tokens, cached = ask(server, name)
            assert tokens == want[name], name
            assert cached == (REUSED if name in seen else 0), (name, seen)
            seen.add(name)
    finally:
        unload_all(server)


def test_an_adapter_reloaded_under_its_name_reuses_none_of_its_pages(server, adapter_dirs):
    call(server, "load_lora_adapter", "b", adapter_dirs["b"])
    want_b = cold(server, "b")
    call(server, "unload_lora_adapter", "b")
    call(server, "flush_cache")
    try:
        call(server, "load_lora_adapter", "policy", adapter_dirs["a"])
        first, _ = ask(server, "policy")
        assert ask(server, "policy") == (first, REUSED)
        call(server, "unload_lora_adapter", "policy")
        call(server, "load_lora_adapter", "policy", adapter_dirs["b"])  # same name, other weights
        assert ask(server, "policy") == (want_b, 0)
        assert ask(server, "policy") == (want_b, REUSED)
        assert first != want_b
    finally:
        unload_all(server)


def test_a_weight_update_leaves_no_cached_pages_from_before_it(server, adapter_dirs, qwen3_dir, qwen3_dir_b):
    call(server, "load_lora_adapter", "a", adapter_dirs["a"])
    call(server, "flush_cache")
    try:
        before = {name: ask(server, name)[0] for name in (None, "a")}
        assert ask(server, None)[1] == ask(server, "a")[1] == REUSED
        call(server, "update_weights_from_disk", qwen3_dir_b, weight_version="b")
        after = {name: ask(server, name) for name in (None, "a")}
        assert after[None] == (reference_greedy(qwen3_dir_b, PROMPT, GREEDY["max_new_tokens"])[0], 0)
        assert after["a"][1] == 0 and after["a"][0] != before["a"]
        assert ask(server, "a") == (after["a"][0], REUSED)  # pages made after the update are reused
        assert cold(server, "a") == after["a"][0]
    finally:
        call(server, "update_weights_from_disk", qwen3_dir, weight_version="default")
        unload_all(server)


@pytest.fixture(scope="module")
def seed(qwen3_dir_b, tmp_path_factory):
    """An R-Fork seed serving qwen3_dir_b."""
    with engine_server(qwen3_dir_b, tmp_path_factory.mktemp("seed"), extra=TIMEOUT) as proc:
        yield proc


def test_a_pull_under_a_paused_request_leaves_no_pages_of_the_old_weights(server, seed, qwen3_dir, qwen3_dir_b):
    """An R-Fork pull while a request is paused in place: the request goes on from KV the new weights
    made (recomputed), and a repeat of its prompt reuses only pages made after the pull."""
    made, tokens = 3, 8
    call(server, "flush_cache")

    async def go():
        async with client_for(server) as client:
            sampling = {**GREEDY, "max_new_tokens": tokens}
            task = await held_in_flight(client, steps=made, input_ids=PROMPT, sampling_params=sampling)
            try:
                before = (await client.get_server_info())["scheduler_stats"]
                await client.load_from_remote_instance("127.0.0.1", seed.port, [free_port()], timeout_s=20)
            finally:
                await client.continue_generation()
            out = await task
            after = (await client.get_server_info())["scheduler_stats"]
            repeat = await client.generate(input_ids=PROMPT, sampling_params=GREEDY)
            return out, after["recomputed_prefixes"] - before["recomputed_prefixes"], repeat

    try:
        out, recomputed, repeat = run(go())
    finally:
        call(server, "update_weights_from_disk", qwen3_dir, weight_version="default")
    assert recomputed == 1
    assert out["output_ids"][:made] == reference_greedy(qwen3_dir, PROMPT, made)[0]
    prefix = PROMPT + out["output_ids"][:made]
    assert out["output_ids"][made:] == reference_greedy(qwen3_dir_b, prefix, tokens - made)[0]
    assert repeat["meta_info"]["cached_tokens"] == REUSED
    assert repeat["output_ids"] == reference_greedy(qwen3_dir_b, PROMPT, GREEDY["max_new_tokens"])[0]
