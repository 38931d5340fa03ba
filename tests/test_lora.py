"""LoRA end to end: peft adapters made here, sent by the lora transport (as tensors and as a
directory) into real engine processes (tp=1, tp=2, and a tp=2 ep=2 MoE), served by merge on
activation. Adapter generations equal a plain forward pass of peft's merge_and_unload, base
generations stay equal to the base model's, fingerprints prove what arrived, bad adapters change
nothing, and base weight updates while an adapter is loaded keep both right."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray
import torch
from conftest import call, engine_servers, every_engine, reference_greedy
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from waits import fleet_state, wait_until

from rollfleet.config import LoraSync, TensorSync, load_config
from rollfleet.engine.lora.host_copies import host_copies
from rollfleet.engine.lora.lora import TENSORS_PATH, LoraError, LoraLimits, parse_adapter
from rollfleet.engine.lora.targets import lora_targets
from rollfleet.engine.process.launch import EngineProcess
from rollfleet.engine.process.server_args import build_parser, check_args
from rollfleet.fleet.fleet import Fleet
from rollfleet.tiny_models import tiny_config
from rollfleet.weights.adapter import _PLANS, LoraSource, SavedAdapter, adapter_config_dict, save_adapter
from rollfleet.weights.transports import EngineTarget, make_transport
from rollfleet.weights.transports import lora as lora_transport
from rollfleet.weights.transports.base import transport_class
from rollfleet.weights.transports.disk import version_dir
from rollfleet.weights.transports.lora import LoraTransport
from rollfleet.weights.transports.staging import PackPlan, call_bytes
from rollfleet.weights.verify import find_unverified
from rollfleet.wire.client import EngineClient, EngineError
from rollfleet.wire.fingerprint import DEFAULT_SAMPLES, fingerprints
from rollfleet.wire.serialize import serialize

PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
DENSE_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8"]


def make_adapter(model_dir: str, targets: list[str], seed: int = 0, **config) -> PeftModel:
    """A peft model whose adapter changes the output: peft starts lora_B at zero, so it is drawn here."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, **config}))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return peft_model


def merged_dir(peft_model: PeftModel, directory) -> str:
    """peft's own merge of the adapter into its base model, saved as a HF directory (the reference)."""
    copy.deepcopy(peft_model).merge_and_unload().save_pretrained(directory)
    return str(directory)


def on_base(peft_model: PeftModel, base_dir: str) -> PeftModel:
    """The same adapter tensors on other base weights."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    other = get_peft_model(model, copy.deepcopy(peft_model.peft_config["default"]))
    set_peft_model_state_dict(other, get_peft_model_state_dict(peft_model))
    return other


def expected(model_dir: str) -> list[tuple[list[int], list[float]]]:
    return [reference_greedy(model_dir, prompt, GREEDY["max_new_tokens"]) for prompt in PROMPTS]


def generate(proc, lora_path=None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and logprobs of PROMPTS in one batch request (lora_path: one name for all, or a list)."""
    outs = call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, lora_path=lora_path)
    return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def generate_together(proc, lora_path) -> tuple[list, int]:
    """generate() with every prompt waiting before the scheduler forms a batch (generation is paused
    until the request is queued); also returns how many batches it took."""
    call(proc, "pause_generation", "in_place")
    with ThreadPoolExecutor(1) as pool:
        try:
            future = pool.submit(generate, proc, lora_path)
            wait_until_queued(proc, future)
            batches = call(proc, "get_server_info")["scheduler_stats"]["batches"]
        finally:
            call(proc, "continue_generation")
        out = future.result()
    return out, call(proc, "get_server_info")["scheduler_stats"]["batches"] - batches


def wait_until_queued(proc, future) -> None:
    """Until the server holds unfinished requests (/flush_cache answers 400 then)."""
    wait_until(
        lambda: httpx.post(f"{proc.url}/flush_cache", timeout=10).status_code == 400,
        what="requests queued",
        alive=lambda: not future.done(),
    )


def wait_until_draining(proc, name: str, future) -> None:
    """Until the engine unloads adapter `name` (an unload or an eviction; `future`: the call that asked),
    its control queued behind the requests using it that a pause holds. (A queued control alone said
    less: an evicting load's own control is queued too, before the eviction starts.)"""
    wait_until(
        lambda: (
            name in call(proc, "get_server_info")["rollfleet_lora_unloading"]
            and call(proc, "get_server_info")["scheduler_stats"]["queued_controls"]
        ),
        what=f"adapter {name!r} being unloaded",
        alive=lambda: not future.done(),
    )


def assert_matches(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4)


def loaded(proc) -> dict[str, str]:
    """The adapters an engine lists where SGLang does (/v1/models cards with a parent), checked
    against the embedded engine's own /get_model_info field."""
    adapters = call(proc, "loaded_lora_adapters")
    assert adapters == call(proc, "get_model_info")["loaded_lora_adapters"]
    return adapters


def unverified(report, procs: dict[int, EngineProcess]) -> dict[int, str]:
    async def go():
        clients = {e: EngineClient(p.url, timeout=60) for e, p in procs.items()}
        try:
            return await find_unverified(report, clients)
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()))

    return asyncio.run(go())


def sync(spec: LoraSync, source: LoraSource, version: str, procs: dict[int, EngineProcess], ranks: dict[int, int]):
    """One sync; the adapter directory every sync leaves goes to a temporary directory unless the spec names one."""
    if spec.path == LoraSync().path:
        with tempfile.TemporaryDirectory(prefix="rf-adapters-") as scratch:
            return sync(spec.model_copy(update={"path": scratch}), source, version, procs, ranks)
    transport = make_transport(
        spec,
        [EngineTarget(engine_id=e, url=p.url, num_ranks=ranks[e], rank_offset=0) for e, p in procs.items()],
        timeout_s=60,
    )
    try:
        return transport.send(source, version)
    finally:
        transport.disconnect()


def tensors_payload(tensors: dict[str, torch.Tensor], ranks: int) -> list[str]:
    return [serialize(list(tensors.items())) for _ in range(ranks)]


@pytest.fixture(scope="module")
def servers(qwen3_dir, moe_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    plan = {
        "tp1": (qwen3_dir, {"extra": [*LORA_FLAGS, "--max-loaded-loras", "2"]}),
        "tp2": (qwen3_dir, {"tp_size": 2, "extra": LORA_FLAGS}),
        "moe": (moe_dir, {"tp_size": 2, "ep_size": 2, "extra": ["--enable-lora"]}),
    }
    with engine_servers(plan, logs) as procs:
        yield procs


@pytest.fixture(scope="module")
def adapter(qwen3_dir, tmp_path_factory):
    """(peft model, greedy tokens and logprobs of its peft merge) on the tiny Qwen3."""
    peft_model = make_adapter(qwen3_dir, DENSE_TARGETS)
    return peft_model, expected(merged_dir(peft_model, tmp_path_factory.mktemp("merged")))


@pytest.fixture(scope="module")
def base_expected(qwen3_dir):
    return expected(qwen3_dir)


# ---- dense tp=1 and tp=2 ----------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["tensors", "directory"])
def test_transport_sends_an_adapter_that_serves_like_peft_merge(
    servers, adapter, base_expected, source, tmp_path, qwen3_dir
):
    peft_model, want = adapter
    assert want != base_expected  # the adapter changes what the model says
    engines = {0: servers["tp1"], 1: servers["tp2"]}
    spec = LoraSync(source=source, path=str(tmp_path / "adapters"))
    # synced three times: each version is a new name, and each sync unloads the one before; of the
    # directories the syncs left, the newest KEEP_LAST stay (pruned after each sync, off its path)
    for version in (f"{source}-1", f"{source}-2", f"{source}-3"):
        report = sync(spec, LoraSource(peft_model), version, engines, ranks={0: 1, 1: 2})
    kept = sorted(p.name for p in (tmp_path / "adapters").iterdir())
    assert kept == [f"version-{source}-2", f"version-{source}-3"] and "prune" not in report.phases
    name = report.lora_name
    assert name == f"policy-v{source}-3" and report.tensors == len(get_peft_model_state_dict(peft_model)) == 16
    assert unverified(report, engines) == {}
    bad = copy.deepcopy(report)
    key = sorted(bad.fingerprints[1])[3]
    bad.fingerprints[1][key] = "0" * 24
    problems = unverified(bad, engines)
    assert list(problems) == [1] and key in problems[1]
    for proc in engines.values():
        assert list(loaded(proc)) == [name]
        assert call(proc, "get_model_info")["weight_version"] == f"{source}-3"
        assert_matches(generate(proc, name), want)
        assert_matches(generate(proc), base_expected)
        mixed, batches = generate_together(proc, [name, None])  # two adapters (one is none): two batches
        assert batches == 2
        assert_matches(mixed, [want[0], base_expected[1]])
    if source == "directory":  # what the transport wrote is a peft adapter directory
        directory = tmp_path / "adapters" / "version-directory-3"
        assert loaded(servers["tp1"])[name] == str(directory.resolve())
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_dir), directory)
        sent = get_peft_model_state_dict(peft_model)
        assert all(torch.equal(t, sent[k]) for k, t in get_peft_model_state_dict(reloaded).items())


def test_a_restore_waits_for_the_directory_a_sync_is_still_writing(tmp_path):
    """A sync returns while its adapter directory is written (`<dir>.partial`, renamed when whole): the
    version counts as available (recovery asks under its lock: no wait there), and a restore given time
    waits for the rename and gets the directory; one with neither gets None at once, and a partial
    never finished is given up when the restore's time is out."""
    spec = LoraSync(path=str(tmp_path / "adapters"))
    final = version_dir(spec.path, "7")
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(parents=True)
    tensors = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(2, 4))]
    looks = []

    def writer_finishes(seconds):  # the restore's wait, during which the sync's writer renames the directory
        looks.append(seconds)
        save_adapter(tensors, {"r": 2, "lora_alpha": 4}, final)

    assert LoraTransport.writing_adapter(spec, "7") and LoraTransport.saved_adapter(spec, "7") is None  # no wait
    assert LoraTransport.saved_adapter(spec, "7", wait_s=30, sleep=writer_finishes) == str(final.resolve())
    assert len(looks) == 1 and not partial.exists() and not LoraTransport.writing_adapter(spec, "7")
    assert LoraTransport.saved_adapter(spec, "8", wait_s=30, sleep=looks.append) is None and len(looks) == 1
    version_dir(spec.path, "9").with_name("version-9.partial").mkdir()  # a writer that died mid-write
    assert LoraTransport.saved_adapter(spec, "9", wait_s=2, sleep=looks.append) is None
    assert sum(looks[1:]) == pytest.approx(2, abs=lora_transport.SAVE_POLL_S)


def test_one_transport_packs_every_version_into_one_buffer_and_each_arrives(servers, adapter, tmp_path):
    """Engines that copy adapters at load (/get_server_info says so) let the sender pack each sync
    into the last one's buffer (its shared memory, or CUDA IPC handle, stays open there): a second
    version, of other values, arrives whole on a tp=1 and a tp=2 engine."""
    peft_model = copy.deepcopy(adapter[0])
    engines = {0: servers["tp1"], 1: servers["tp2"]}
    targets = [
        EngineTarget(engine_id=e, url=p.url, num_ranks=r, rank_offset=0) for (e, p), r in zip(engines.items(), (1, 2))
    ]
    transport = make_transport(LoraSync(source="tensors", path=str(tmp_path / "adapters")), targets, timeout_s=60)
    try:
        first = transport.send(LoraSource(peft_model), "reuse-1")
        buffer = transport._buffer
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.25)
        second = transport.send(LoraSource(peft_model), "reuse-2")
        assert transport._reuse and buffer is not None and transport._buffer is buffer
        assert first.fingerprints != second.fingerprints
        assert unverified(second, engines) == {}
        for proc in engines.values():
            assert list(loaded(proc)) == [second.lora_name]
    finally:
        transport.disconnect()


def test_a_reused_buffer_is_mapped_once_then_named_by_its_id(servers, adapter, tmp_path):
    """Embedded engines keep the sender's buffer under an id (load_format "rollfleet_resident"); later
    loads name the id alone and the engines read the values packed into it since. An engine that
    loaded another sender's adapter in between no longer holds the id: it refuses, and is sent the
    buffer again in the same sync. The values served are the last ones packed (greedy = peft's)."""
    peft_model, want = copy.deepcopy(adapter[0]), adapter[1]
    engines = {0: servers["tp1"], 1: servers["tp2"]}
    targets = [
        EngineTarget(engine_id=e, url=p.url, num_ranks=r, rank_offset=0) for (e, p), r in zip(engines.items(), (1, 2))
    ]
    transport = make_transport(LoraSync(source="tensors", path=str(tmp_path / "adapters")), targets, timeout_s=60)
    sent: list[dict] = []
    real_each = transport._each

    def each(verb, make_args, engine_ids=None):  # records what each load carried (the real call goes on)
        if verb == "load_lora_adapter_from_tensors":
            for t in transport.targets:
                if engine_ids is None or t.engine_id in engine_ids:
                    (_, _, parts), kwargs = make_args(t)
                    sent.append({"engine": t.engine_id, "format": kwargs["load_format"], "bytes": len(parts[0])})
        return real_each(verb, make_args, engine_ids)

    transport._each = each

    def lora_b(delta: float) -> None:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.add_(delta)

    try:
        first = transport.send(LoraSource(peft_model), "map-1")
        assert {s["format"] for s in sent} == {"rollfleet_resident"} and transport.mapping.holding == {0, 1}
        carried = {s["engine"]: s["bytes"] for s in sent}
        lora_b(0.25)
        sent.clear()
        second = transport.send(LoraSource(peft_model), "map-2")
        assert [s["engine"] for s in sent] == [0, 1] and all(s["bytes"] < carried[s["engine"]] / 4 for s in sent)
        assert first.fingerprints != second.fingerprints and unverified(second, engines) == {}
        # another sender's load on tp1: its buffer is not ours
        source = LoraSource(adapter[0])
        call(
            engines[0],
            "load_lora_adapter_from_tensors",
            "other",
            source.config_dict(),
            tensors_payload(dict(source.named_tensors()), 1),
        )
        call(engines[0], "unload_lora_adapter", "other")
        lora_b(-0.25)
        sent.clear()
        third = transport.send(LoraSource(peft_model), "map-3")
        assert [(s["engine"], s["bytes"] < carried[s["engine"]] / 4) for s in sent] == [
            (0, True),
            (1, True),
            (0, False),
        ]
        assert transport.mapping.holding == {0, 1} and unverified(third, engines) == {}
        for proc in engines.values():
            assert list(loaded(proc)) == [third.lora_name]
            assert_matches(generate(proc, [third.lora_name, third.lora_name])[:1], want[:1])
    finally:
        transport.disconnect()
        for proc in engines.values():
            unload_all(proc)


def test_a_mapping_id_the_engine_does_not_hold_is_refused(servers):
    """An id alone, or a malformed "rollfleet_resident" entry, is a 400 naming the field; nothing loads."""
    proc = servers["tp1"]
    before = loaded(proc)
    for entry, offender in (
        ({"mapping": "never-sent", "tensors": None}, "mapping 'never-sent' is not held by this engine"),
        ({"mapping": 7, "tensors": None}, "mapping='7' must be a string"),
        ({"id": "x"}, "expects each entry to be {'mapping': id, 'tensors': pairs or None}"),
    ):
        with pytest.raises(EngineError) as err:
            call(
                proc,
                "load_lora_adapter_from_tensors",
                "resident",
                {"r": 2, "lora_alpha": 4},
                [serialize(entry)],
                load_format="rollfleet_resident",
            )
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
        assert loaded(proc) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's streams (the GPU checks run it)")
def test_the_directory_writers_host_copy_is_the_packed_bucket_in_pinned_memory():
    """The writer copies a bucket on a GPU to pinned host memory on a side stream, after what the
    current stream queued before (the pack): the values written last are what it copies."""
    from rollfleet.weights.adapter import host_copy

    flat = torch.arange(1 << 22, dtype=torch.int32, device="cuda").view(torch.uint8)
    flat.add_(1)  # queued on the current stream, not waited for
    host = host_copy(flat)
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, flat.cpu())
    on_host = torch.arange(10, dtype=torch.uint8)
    assert host_copy(on_host) is on_host  # nothing to copy


def test_the_adapter_directory_holds_the_pushed_values_though_the_trainer_steps_at_once(servers, adapter, tmp_path):
    """The directory a restarted engine restores from is written after the sync returned; a trainer
    steps its parameters as soon as it did. The writer saves the bucket as pushed (here kept busy
    until the step happened: before, it read the live parameters and saved the stepped values)."""
    peft_model = copy.deepcopy(adapter[0])
    spec = LoraSync(source="tensors", path=str(tmp_path / "adapters"))
    target = EngineTarget(engine_id=0, url=servers["tp1"].url, num_ranks=1, rank_offset=0)
    transport = make_transport(spec, [target], timeout_s=60)
    stepped = threading.Event()
    try:
        transport._writing().submit(stepped.wait)  # the writing thread busy until the trainer stepped
        report = transport.send(LoraSource(peft_model), "pushed")
        pushed = {key: tensor.clone() for key, tensor in get_peft_model_state_dict(peft_model).items()}
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.add_(1.0)
        stepped.set()
        transport.settle()  # what the next sync waits for first (and the sync bench before timing one)
        saved = load_file(version_dir(spec.path, "pushed") / SavedAdapter.WEIGHTS_FILE)
        assert saved.keys() == pushed.keys()
        assert [key for key in pushed if not torch.equal(saved[key], pushed[key])] == []
        assert unverified(report, {0: servers["tp1"]}) == {}
    finally:
        stepped.set()
        transport.disconnect()


def test_base_update_while_an_adapter_is_loaded(servers, adapter, qwen3_dir, qwen3_dir_b, tmp_path):
    peft_model, want = adapter
    proc = servers["tp2"]
    name = sync(LoraSync(), LoraSource(peft_model), "a", {0: proc}, ranks={0: 2}).lora_name
    assert_matches(generate(proc, name), want)  # the adapter is merged now
    # fingerprints read the base weights, not the merged ones
    base_prints = fingerprints(load_file(f"{qwen3_dir}/model.safetensors").items())
    assert call(proc, "weights_fingerprint", sorted(base_prints)) == base_prints
    call(proc, "update_weights_from_disk", qwen3_dir_b, weight_version="b")
    assert_matches(generate(proc), expected(qwen3_dir_b))
    assert_matches(generate(proc, name), expected(merged_dir(on_base(peft_model, qwen3_dir_b), tmp_path / "m")))
    call(proc, "update_weights_from_disk", qwen3_dir, weight_version="a")
    assert_matches(generate(proc, [name, None]), [want[0], expected(qwen3_dir)[1]])


def test_a_base_read_mid_batch_keeps_the_adapter(servers, adapter):
    """Fingerprints restore the base weights; a batch paused in place around them goes on with its adapter."""
    proc = servers["tp2"]
    name = sync(LoraSync(), LoraSource(adapter[0]), "mid", {0: proc}, ranks={0: 2}).lora_name
    request = {
        "input_ids": PROMPTS[0],
        "sampling_params": {**GREEDY, "max_new_tokens": 40},
        "return_logprob": True,
        "lora_path": name,
    }
    uninterrupted = call(proc, "generate", **request)
    batches = call(proc, "get_server_info")["scheduler_stats"]["batches"]
    call(proc, "pause_generation", "in_place")
    with ThreadPoolExecutor(1) as pool:
        try:
            running = pool.submit(call, proc, "generate", **request)
            wait_until_queued(proc, running)
            stepped = call(proc, "step", 5)  # its batch started and made 5 tokens, held there
            assert stepped["steps_run"] == 5 and stepped["scheduler_stats"]["running_requests"] == 1, stepped
            assert stepped["scheduler_stats"]["batches"] == batches + 1
            call(proc, "weights_fingerprint", ["model.layers.0.self_attn.q_proj.weight"])
        finally:
            call(proc, "continue_generation")
        out = running.result()
    assert out["output_ids"] == uninterrupted["output_ids"]
    assert out["meta_info"]["output_token_logprobs"] == uninterrupted["meta_info"]["output_token_logprobs"]


def test_unload_and_unknown_adapters(servers, adapter, base_expected, tmp_path):
    peft_model, want = adapter
    proc = servers["tp1"]  # started with --max-loaded-loras 2
    source = LoraSource(peft_model)
    name = sync(LoraSync(), source, "u", {0: proc}, ranks={0: 1}).lora_name
    directory = save_adapter(source.named_tensors(), source.config_dict(), tmp_path / "extra")
    out = call(proc, "load_lora_adapter", "extra", str(directory))
    assert out["success"] is True and out["loaded_adapters"] == {name: "__tensor__", "extra": str(directory)}
    assert_matches(generate(proc, name), want)  # loaded first, used last: "extra" is the least recently used
    out = call(proc, "load_lora_adapter", "third", str(directory))  # past --max-loaded-loras: SGLang's LRU eviction
    assert out["success"] is True and out["loaded_adapters"] == {name: "__tensor__", "third": str(directory)}
    assert loaded(proc) == out["loaded_adapters"]
    assert_matches(generate(proc, "third"), want)
    out = call(proc, "unload_lora_adapter", "third")
    assert out["success"] is True and "third" not in out["loaded_adapters"]
    for request in ({"lora_path": "extra"}, {"lora_path": ["extra", None]}):
        with pytest.raises(EngineError) as err:
            call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY, **request)
        assert err.value.status_code == 400 and "'extra' is not a loaded LoRA adapter" in err.value.message
        assert str(sorted(loaded(proc))) in err.value.message  # names what is loaded
    with pytest.raises(EngineError) as err:
        call(proc, "unload_lora_adapter", "extra")
    assert err.value.status_code == 400 and "not loaded" in err.value.message
    with pytest.raises(EngineError) as err:
        call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY, lora_path=["extra"])
    assert "1 entries for 2 prompts" in err.value.message
    assert_matches(generate(proc), base_expected)


def test_unload_waits_for_the_requests_that_use_the_adapter(servers, adapter, tmp_path):
    peft_model, want = adapter
    proc = servers["tp1"]
    source = LoraSource(peft_model)
    call(
        proc,
        "load_lora_adapter",
        "slow",
        str(save_adapter(source.named_tensors(), source.config_dict(), tmp_path / "slow")),
    )
    call(proc, "pause_generation", "in_place")  # the request below stays queued until generation continues
    with ThreadPoolExecutor(2) as pool:
        try:
            queued = pool.submit(generate, proc, "slow")
            wait_until_queued(proc, queued)
            unloading = pool.submit(call, proc, "unload_lora_adapter", "slow")
            wait_until_draining(proc, "slow", unloading)
            assert not unloading.done()  # it waits for the queued request (held by the pause) that uses the adapter
            with pytest.raises(EngineError) as err:  # and new requests for the adapter are refused meanwhile
                call(proc, "generate", input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="slow")
            assert "being unloaded" in err.value.message
        finally:
            call(proc, "continue_generation")
        assert_matches(queued.result(), want)
        assert "slow" not in unloading.result()["loaded_adapters"]


def unload_all(proc) -> None:
    for name in loaded(proc):
        call(proc, "unload_lora_adapter", name)


def test_eviction_spares_pinned_adapters_and_waits_for_requests(servers, adapter, tmp_path):
    """SGLang's rule past --max-loaded-loras: the least recently used adapter that is not pinned goes,
    once the requests already using it finished; a pinned load may not take the last free slot."""
    peft_model, want = adapter
    proc = servers["tp1"]  # --max-loaded-loras 2
    unload_all(proc)
    source = LoraSource(peft_model)
    directory = str(save_adapter(source.named_tensors(), source.config_dict(), tmp_path / "adapter"))
    call(proc, "load_lora_adapter", "kept", directory, pinned=True)
    call(proc, "load_lora_adapter", "used", directory)
    with pytest.raises(EngineError) as err:
        call(proc, "load_lora_adapter", "pinned-too", directory, pinned=True)
    assert "1 of --max-loaded-loras=2 adapters are pinned" in err.value.message
    assert sorted(loaded(proc)) == ["kept", "used"]
    call(proc, "pause_generation", "in_place")  # the request below stays queued until generation continues
    with ThreadPoolExecutor(2) as pool:
        try:
            queued = pool.submit(generate, proc, "used")
            wait_until_queued(proc, queued)
            loading = pool.submit(call, proc, "load_lora_adapter", "new", directory)
            wait_until_draining(proc, "used", loading)
            assert not loading.done()  # "kept" is older but pinned: "used" goes, after its queued request
            with pytest.raises(EngineError) as err:
                call(proc, "generate", input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="used")
            assert "being unloaded" in err.value.message
        finally:
            call(proc, "continue_generation")
        assert_matches(queued.result(), want)
        assert loading.result()["loaded_adapters"] == {"kept": directory, "new": directory}
    assert_matches(generate(proc, "new"), want)
    unload_all(proc)


def test_sglang_lora_payload_forms(servers, adapter):
    """SGLang 0.5.2x sends one payload per rank holding a dict {peft key: tensor}; older SGLang and UniRL
    send `serialized_tensors`, one payload that every rank reads."""
    peft_model, want = adapter
    source = LoraSource(peft_model)
    config = source.config_dict()

    def fresh() -> dict[str, torch.Tensor]:  # new storages per payload: a shared one is not named twice
        return {key: tensor.clone() for key, tensor in source.named_tensors()}

    def post(proc, **body):
        return httpx.post(
            f"{proc.url}/load_lora_adapter_from_tensors", json={"config_dict": config, **body}, timeout=60
        )

    tp1, tp2 = servers["tp1"], servers["tp2"]
    unload_all(tp1)
    unload_all(tp2)
    answer = post(tp1, lora_name="dict", serialized_named_tensors=[serialize(fresh())])
    assert answer.status_code == 200 and answer.json()["loaded_adapters"] == {"dict": "__tensor__"}, answer.text
    # one serialization is one shared-memory reference, and each reading rank drops one: a sender of
    # `serialized_tensors` to tp ranks keeps its tensors alive and adds the extra references (as UniRL does)
    shared = fresh()
    single = serialize(shared)
    for tensor in shared.values():
        tensor.untyped_storage()._shared_incref()
    answer = post(tp2, lora_name="one", serialized_tensors=single)
    assert answer.status_code == 200 and answer.json()["loaded_adapters"] == {"one": "__tensor__"}, answer.text
    assert_matches(generate(tp1, "dict"), want)
    assert_matches(generate(tp2, "one"), want)
    both = {"serialized_tensors": serialize(fresh()), "serialized_named_tensors": [serialize(fresh())]}
    for body in (both, {}):
        answer = post(tp1, lora_name="bad", **body)
        assert answer.status_code == 400 and "exactly one of 'serialized_named_tensors'" in answer.text
    assert list(loaded(tp1)) == ["dict"]
    unload_all(tp1)
    unload_all(tp2)


def _bad_adapters(peft_model, qwen3_dir, tmp_path):
    """(lora_name, how to load it, what the refusal names), all against an engine holding 'policy-vgood'."""
    config = LoraSource(peft_model).config_dict()
    good = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong_shape = {**good, q_a: torch.zeros(4, 63)}
    unknown = {
        **good,
        "base_model.model.model.layers.0.self_attn.qq_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.0.self_attn.qq_proj.lora_B.weight": torch.zeros(64, 4),
    }
    big = make_adapter(qwen3_dir, ["q_proj"], r=16)
    big_source = LoraSource(big)
    rank_mismatch = {
        **good,
        q_a: torch.zeros(2, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2),
    }
    dora = save_adapter(good.items(), {**config, "use_dora": True}, tmp_path / "dora")
    embed_source = LoraSource(make_adapter(qwen3_dir, ["embed_tokens", "q_proj"]))
    return [
        ("wrong-shape", ("tensors", config, wrong_shape), f"{q_a}: shape (4, 63), expected (r, 64)"),
        ("unknown", ("tensors", config, unknown), "module 'model.layers.0.self_attn.qq_proj' cannot be a LoRA target"),
        ("big", ("tensors", big_source.config_dict(), dict(big_source.named_tensors())), "rank 16 > --max-lora-rank 8"),
        ("mismatch", ("tensors", config, rank_mismatch), "rank 2 differs from the config's r=4"),
        (  # an input embedding's adapter: served at tp 1 only
            "embed",
            ("tensors", embed_source.config_dict(), dict(embed_source.named_tensors())),
            "module 'model.embed_tokens' cannot be a LoRA target: an embedding target is served at tp 1 only",
        ),
        ("policy-vgood", ("tensors", config, good), "lora_name='policy-vgood' is already loaded"),
        ("dora", ("directory", str(dora)), "use_dora=True"),
        ("missing", ("directory", str(tmp_path / "nope")), "is not a directory"),
        # a name the filesystem refuses (ENAMETOOLONG) raised out of the route: the client's connection dropped
        ("long-path", ("directory", "x" * 400), "... (400 characters) cannot be read (File name too long)"),
        # a null pattern value raised TypeError on every rank, outside the refusal path: the engine stopped
        ("null-alpha", ("tensors", {**config, "alpha_pattern": {"q_proj": None}}, good), "{'q_proj': None}: each"),
        ("list-pattern", ("tensors", {**config, "rank_pattern": ["q_proj"]}, good), "must be a dict"),
    ]


def _load(proc, ranks: int, name: str, how):
    if how[0] == "directory":
        return call(proc, "load_lora_adapter", name, how[1])
    return call(proc, "load_lora_adapter_from_tensors", name, how[1], tensors_payload(how[2], ranks))


def test_bad_adapters_change_nothing(servers, adapter, qwen3_dir, tmp_path):
    peft_model, want = adapter
    proc = servers["tp2"]
    name = sync(LoraSync(), LoraSource(peft_model), "good", {0: proc}, ranks={0: 2}).lora_name
    before, tokens = loaded(proc), generate(proc, [name, None])
    for bad, how, offender in _bad_adapters(peft_model, qwen3_dir, tmp_path):
        with pytest.raises(EngineError) as err:
            _load(proc, 2, bad, how)
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
        assert loaded(proc) == before
    assert generate(proc, [name, None]) == tokens
    assert_matches(tokens[:1], want[:1])


def test_a_refused_sync_leaves_no_adapter_directory(servers, adapter, qwen3_dir, tmp_path):
    """The directory is written once the engines took the version: a sync they refuse writes none (a
    restore must not find a version that never loaded); one a successful sync of that version left stays."""
    peft_model, _ = adapter
    proc = servers["tp2"]
    spec = LoraSync(path=str(tmp_path / "adapters"))
    report = sync(spec, LoraSource(peft_model), "kept", {0: proc}, ranks={0: 2})
    assert {"source", "pack", "fingerprint", "serialize", "load", "save"} <= set(report.phases)
    assert "versions" not in report.phases  # one engine: the load's call set the version
    big = LoraSource(make_adapter(qwen3_dir, ["q_proj"], r=16))  # rank 16 > --max-lora-rank 8
    for version in ("refused", "kept"):
        with pytest.raises(EngineError, match="rank 16 > --max-lora-rank 8"):
            sync(spec, big, version, {0: proc}, ranks={0: 2})
    assert LoraTransport.saved_adapter(spec, "refused") is None
    kept = load_file(Path(LoraTransport.saved_adapter(spec, "kept")) / SavedAdapter.WEIGHTS_FILE)
    sent = get_peft_model_state_dict(peft_model)
    assert kept.keys() == sent.keys() and all(torch.equal(kept[k], sent[k]) for k in sent)
    assert list(loaded(proc)) == []  # the resend unloaded its own name first (a retry), then was refused


def test_a_sync_returns_with_its_directory_under_way(servers, adapter, tmp_path):
    """The directory is written after the sync, in the transport's writing thread; its `.partial` is
    made before the sync returns, so a restore asking right after waits for it instead of finding no
    adapter. The thread is held busy here: the write has not begun when the sync returns."""
    peft_model, _ = adapter
    spec = LoraSync(path=str(tmp_path / "adapters"))
    transport = make_transport(
        spec, [EngineTarget(engine_id=0, url=servers["tp2"].url, num_ranks=2, rank_offset=0)], timeout_s=60
    )
    held = threading.Event()
    try:
        transport._writing().submit(held.wait)
        report = transport.send(LoraSource(peft_model), "7")
        assert LoraTransport.writing_adapter(spec, "7") and LoraTransport.saved_adapter(spec, "7") is None
        held.set()
        directory = LoraTransport.saved_adapter(spec, "7", wait_s=60)
        kept = load_file(Path(directory) / SavedAdapter.WEIGHTS_FILE)
        sent = get_peft_model_state_dict(peft_model)
        assert kept.keys() == sent.keys() and all(torch.equal(kept[k], sent[k]) for k in sent)
        assert report.lora_name in loaded(servers["tp2"])
    finally:
        held.set()
        transport.disconnect()
        call(servers["tp2"], "unload_lora_adapter", lora_transport.served_name(spec.adapter_name, "7"))


def test_a_sync_to_one_engine_sets_the_version_and_unloads_the_old_in_its_load(servers, adapter, tmp_path):
    """To one embedded engine the load's call carries the version and the old versions to unload (one
    round trip, no versions phase); to two, each keeps the old version until both loaded (versions)."""
    peft_model = copy.deepcopy(adapter[0])
    spec = LoraSync(path=str(tmp_path / "adapters"))
    engines = {0: servers["tp2"], 1: servers["tp1"]}
    for proc in engines.values():
        unload_all(proc)
    verbs: list[str] = []
    for count, versions in ((1, ("one-1", "one-2")), (2, ("two-1", "two-2"))):
        targets = [
            EngineTarget(engine_id=e, url=engines[e].url, num_ranks=(2, 1)[e], rank_offset=0) for e in range(count)
        ]
        transport = make_transport(spec, targets, timeout_s=60)
        transport._each = recording(transport._each, verbs)
        try:
            for version in versions:
                verbs.clear()
                report = transport.send(LoraSource(peft_model), version)
            folded = count == 1
            assert ("versions" not in report.phases) == folded, report.phases
            assert ({"update_weight_version", "unload_lora_adapter"} & set(verbs) == set()) == folded, verbs
            assert unverified(report, {e: engines[e] for e in range(count)}) == {}
            for e in range(count):
                assert list(loaded(engines[e])) == [report.lora_name]
                assert call(engines[e], "get_server_info")["weight_version"] == versions[-1]
        finally:
            transport.disconnect()
    for proc in engines.values():
        unload_all(proc)


def recording(each, verbs: list[str]):
    """A transport's `_each` that notes each verb it is called with (the real call goes on)."""

    def recorded(verb, make_args, engine_ids=None):
        verbs.append(verb)
        return each(verb, make_args, engine_ids)

    return recorded


def test_a_load_refuses_adapters_to_unload_after_it_before_loading(servers, adapter):
    """rollfleet_unload_lora_names names loaded adapters, once each, never the one loaded; else a 400
    naming the field, and nothing loads, unloads or changes version."""
    proc = servers["tp1"]
    unload_all(proc)
    source = LoraSource(adapter[0])
    payload = tensors_payload(dict(source.named_tensors()), 1)
    call(proc, "load_lora_adapter_from_tensors", "kept", source.config_dict(), payload)
    version = call(proc, "get_server_info")["weight_version"]

    def load_new(then_version: str, names: list[str]):
        return call(
            proc,
            "load_lora_adapter_from_tensors",
            "new",
            source.config_dict(),
            payload,
            weight_version=then_version,
            unload_lora_names=names,
        )

    for names, why in (
        (["new"], "is the adapter this call loads"),
        (["gone"], "is not loaded"),
        (["kept"] * 2, "named twice"),
    ):
        with pytest.raises(EngineError) as err:
            load_new("never", names)
        assert err.value.status_code == 400 and "rollfleet_unload_lora_names=" in err.value.message
        assert why in err.value.message, err.value.message
        assert list(loaded(proc)) == ["kept"] and call(proc, "get_server_info")["weight_version"] == version
    load_new("v-new", ["kept"])
    assert list(loaded(proc)) == ["new"] and call(proc, "get_server_info")["weight_version"] == "v-new"
    unload_all(proc)


def test_adapter_fingerprints_cover_every_rank(servers, adapter):
    """Each rank decodes its own payload: a rank holding other values fails the adapter's verification."""
    proc = servers["tp2"]
    source = LoraSource(adapter[0])
    tensors = {k: v.clone() for k, v in source.named_tensors()}
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    other = {**tensors, key: tensors[key] + 1}
    payloads = [serialize(list(tensors.items())), serialize(list(other.items()))]
    call(proc, "load_lora_adapter_from_tensors", "split", source.config_dict(), payloads)
    try:
        prints = call(proc, "weights_fingerprint", None, lora_name="split")
        assert prints[key].startswith("ranks differ")
        assert {k: v for k, v in prints.items() if k != key} == fingerprints(
            (k, t) for k, t in tensors.items() if k != key
        )
    finally:
        call(proc, "unload_lora_adapter", "split")


# ---- MoE: tp=2 ep=2, attention targets ------------------------------------------------------------------
def test_moe_tp2_ep2_serves_an_attention_adapter_and_refuses_experts(servers, moe_dir, tmp_path):
    proc = servers["moe"]
    peft_model = make_adapter(moe_dir, ATTENTION)
    want, base = expected(merged_dir(peft_model, tmp_path / "merged")), expected(moe_dir)
    assert want != base
    report = sync(LoraSync(), LoraSource(peft_model), "moe-1", {0: proc}, ranks={0: 2})
    assert unverified(report, {0: proc}) == {}
    assert_matches(generate(proc, [report.lora_name, None]), [want[0], base[1]])
    # an adapter on the fused experts (peft's target_parameters) is refused, nothing changes
    experts = make_adapter(moe_dir, ["q_proj"], target_parameters=["mlp.experts.down_proj"])
    source = LoraSource(experts)
    tensors = dict(source.named_tensors())
    assert "base_model.model.model.layers.0.mlp.experts.lora_A.weight" in tensors
    config = {**source.config_dict(), "target_parameters": None}  # the module check alone
    for config_dict, offender in (
        (config, "model.layers.0.mlp.experts' cannot be a LoRA target: it is a fused MoE expert module"),
        (source.config_dict(), "target_parameters"),
    ):
        with pytest.raises(EngineError) as err:
            call(proc, "load_lora_adapter_from_tensors", "experts", config_dict, tensors_payload(tensors, 2))
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
    assert list(loaded(proc)) == [report.lora_name]
    assert_matches(generate(proc, [report.lora_name, None]), [want[0], base[1]])


# ---- an engine without --enable-lora -------------------------------------------------------------------
def test_lora_routes_need_enable_lora(qwen3_server, adapter):
    proc = qwen3_server  # conftest's plain server, shared with the engine modules
    source = LoraSource(adapter[0])
    for route, args in (
        ("load_lora_adapter", ("x", "/nowhere")),
        ("unload_lora_adapter", ("x",)),
        (
            "load_lora_adapter_from_tensors",
            ("x", source.config_dict(), tensors_payload(dict(source.named_tensors()), 1)),
        ),
    ):
        with pytest.raises(EngineError) as err:
            call(proc, route, *args)
        assert err.value.status_code == 400 and "--enable-lora" in err.value.message
    with pytest.raises(EngineError) as err:
        call(proc, "generate", input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="x")
    assert err.value.status_code == 400 and "--enable-lora" in err.value.message
    assert call(proc, "get_model_info")["loaded_lora_adapters"] == {}


# ---- the fleet ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["directory", "tensors"])
def test_fleet_of_a_lora_run_serves_the_synced_adapter(local_ray, qwen3_dir, adapter, base_expected, tmp_path, source):
    """With tensors the sync returns while its directory is still written: the restore right after it
    takes the directory once whole (LoraTransport.saved_adapter)."""
    peft_model, want = adapter
    cfg = load_config(
        None,
        [
            f"rollout.model_path={qwen3_dir}",
            "rollout.use_gpu=true",
            f"rollout.log_dir={tmp_path}",
            "weight_sync.transport=lora",
            f"weight_sync.source={source}",
            f"weight_sync.path={tmp_path / 'adapters'}",
            "weight_sync.max_lora_rank=8",
            "rollout.auto_restart=false",
        ],
    )
    fleet = Fleet.from_config(cfg)
    try:
        info = every_engine(fleet, "get_server_info")[0]
        assert info["enable_lora"] is True and info["max_lora_rank"] == 8
        assert [s.output_ids for s in fleet.generate(PROMPTS, sampling=GREEDY)] == [t for t, _ in base_expected]
        report = fleet.sync_weights(LoraSource(peft_model), "1")  # verified inside
        assert report.lora_name == fleet.lora_name == "policy-v1"
        samples = fleet.generate(PROMPTS, sampling=GREEDY)
        assert [s.output_ids for s in samples] == [t for t, _ in want] and {s.weight_version for s in samples} == {"1"}
        # a restarted engine loads the base weights itself (a LoRA run never sends them), then the current
        # adapter from the directory its sync left, verified before it serves
        ray.get(fleet.slots[0].head.kill_engine.remote())
        wait_until(
            lambda: fleet.slots[0].state.value == "INACTIVE",
            what="the killed engine INACTIVE",
            state=lambda: fleet_state(fleet),
        )
        assert fleet.restart_inactive() == [0] and fleet.slots[0].state.value == "ACTIVE"
        assert fleet.slots[0].lifecycle.history[-1].why == "recovered: verified at version '1' (adapter)"
        (base,) = every_engine(fleet, "generate", input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in base] == [t for t, _ in base_expected]  # its base: the model's
        assert [s.output_ids for s in fleet.generate(PROMPTS, sampling=GREEDY)] == [t for t, _ in want]
        fleet.sync_weights(LoraSource(peft_model), "2")
        path = str(tmp_path / "adapters" / "version-2") if source == "directory" else TENSORS_PATH
        assert every_engine(fleet, "loaded_lora_adapters") == [{"policy-v2": path}]
        assert [s.output_ids for s in fleet.generate(PROMPTS, sampling=GREEDY)] == [t for t, _ in want]
    finally:
        fleet.shutdown()


# ---- pure logic ----------------------------------------------------------------------------------------------
def test_scale_follows_rslora_and_patterns(qwen3_dir):
    peft_model = make_adapter(
        qwen3_dir,
        ["q_proj", "v_proj"],
        use_rslora=True,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"layers.1.self_attn.q_proj": 3},
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)  # the engine's: no peft layers
    source = LoraSource(peft_model)
    tensors = dict(source.named_tensors())
    params = dict(model.named_parameters(remove_duplicate=False))
    parsed = parse_adapter(
        "p", "__tensor__", source.config_dict(), tensors, model, lora_targets(model, params), LoraLimits()
    )
    scales = {t.module: t.scale for t in parsed.targets}
    layers = {
        name.removeprefix("base_model.model."): module
        for name, module in peft_model.named_modules()
        if name.endswith(("q_proj", "v_proj"))
    }
    assert scales == {name: module.scaling["default"] for name, module in layers.items()}
    assert scales["model.layers.0.self_attn.v_proj"] == 8 / 2**0.5  # rslora, rank_pattern
    assert scales["model.layers.0.self_attn.q_proj"] == 8 / 2 and scales["model.layers.1.self_attn.q_proj"] == 3 / 2
    # the merge the engine computes equals peft's
    for target in parsed.targets:
        assert torch.equal(target.delta(torch.device("cpu")), layers[target.module].get_delta_weight("default"))
    with pytest.raises(LoraError, match="--lora-target-modules"):
        parse_adapter(
            "p",
            "__tensor__",
            source.config_dict(),
            tensors,
            model,
            lora_targets(model, params),
            LoraLimits(target_modules=frozenset({"q_proj"})),
        )
    for change in [{"lora_alpha": float("nan")}, {"alpha_pattern": {"q_proj": float("inf")}}]:  # NaN weights
        with pytest.raises(LoraError, match="must be a finite number"):
            config = {**source.config_dict(), **change}
            parse_adapter("p", "__tensor__", config, tensors, model, lora_targets(model, params), LoraLimits())
    tied = AutoModelForCausalLM.from_config(
        tiny_config("qwen3", vocab_size=model.config.vocab_size, tie_word_embeddings=True)
    )
    tied_params = dict(tied.named_parameters(remove_duplicate=False))
    assert "lm_head" not in lora_targets(tied, tied_params) and "lm_head" in lora_targets(model, params)


def test_the_adapter_plan_gives_peft_state_dict_until_the_model_changes(qwen3_dir):
    """LoraSource reads the adapter's parameters by a plan made from peft's first answer: the same keys,
    order and tensors as `get_peft_model_state_dict` every time, and made again once the model changed."""
    peft_model = make_adapter(qwen3_dir, ATTENTION)

    def peft_state() -> list[tuple[str, torch.Tensor]]:
        return list(get_peft_model_state_dict(peft_model, adapter_name="default", save_embedding_layers=False).items())

    def same(got: list, want: list) -> bool:  # the parameters' own values, detached as peft gives them
        return [k for k, _ in got] == [k for k, _ in want] and all(
            torch.equal(a, b) and a.data_ptr() == b.data_ptr() and not a.requires_grad
            for (_, a), (_, b) in zip(got, want)
        )

    assert same(list(LoraSource(peft_model).named_tensors()), peft_state())
    plan = _PLANS[peft_model]["default"]
    assert plan is not None and plan.holds(peft_model)
    with torch.no_grad():  # training changes values in place: read again through the plan
        next(p for n, p in peft_model.named_parameters() if "lora_B" in n).add_(1.0)
    assert same(list(LoraSource(peft_model).named_tensors()), peft_state()) and _PLANS[peft_model]["default"] is plan
    layer = peft_model.base_model.model.model.layers[1].self_attn.k_proj
    layer.lora_A["default"].weight = torch.nn.Parameter(torch.ones_like(layer.lora_A["default"].weight))  # replaced
    assert not plan.holds(peft_model)
    assert same(list(LoraSource(peft_model).named_tensors()), peft_state())
    lora_b = layer.lora_B
    layer.lora_B = torch.nn.ModuleDict({"moved": lora_b["default"]})  # the same parameter under another name
    assert not _PLANS[peft_model]["default"].holds(peft_model)
    layer.lora_B = lora_b
    # the config, compared by its fields: a change shows in the plan and in what a sync sends
    assert list(LoraSource(peft_model).named_tensors()) and _PLANS[peft_model]["default"].holds(peft_model)
    config = peft_model.peft_config["default"]
    sent = LoraSource(peft_model).config_dict()
    assert sent == adapter_config_dict(config)
    config.lora_alpha += 1
    assert not _PLANS[peft_model]["default"].holds(peft_model)
    assert LoraSource(peft_model).config_dict() == {**sent, "lora_alpha": sent["lora_alpha"] + 1}
    config.rank_pattern["q_proj"] = 2  # a nested field
    assert LoraSource(peft_model).config_dict()["rank_pattern"] == {"q_proj": 2}
    config.lora_alpha -= 1
    config.rank_pattern.clear()
    assert LoraSource(peft_model).config_dict() == sent and _PLANS[peft_model]["default"].holds(peft_model)
    peft_model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    assert same(list(LoraSource(peft_model).named_tensors()), peft_state())
    assert _PLANS[peft_model]["default"].adapters == ("default", "other")


def test_the_engine_reserves_room_for_a_merged_adapters_saved_weights(qwen3_dir):
    """A merge keeps a copy of each target weight beside the weights: the engine's pool leaves room
    for every weight its adapters may target (kv/setup.py), none with LoRA off."""
    from rollfleet.engine.model.model import ModelRunner

    assert ModelRunner(qwen3_dir).lora.merge_bytes() == 0
    runner = ModelRunner(qwen3_dir, lora=LoraLimits(target_modules=frozenset({"q_proj", "v_proj"})))
    covered = [m.weight for n, m in runner.model.named_modules() if n.endswith(("q_proj", "v_proj"))]
    assert runner.lora.merge_bytes() == sum(w.nbytes for w in covered) > 0
    every = ModelRunner(qwen3_dir, lora=LoraLimits())  # no --lora-target-modules: any targetable weight
    assert every.lora.merge_bytes() == sum(
        m.weight.nbytes for m in every.model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_merge_writes_w_plus_scale_b_a_rounded_once_and_restores_the_base(
    qwen3_dir, tmp_path, dtype, monkeypatch, caplog
):
    """Each target becomes (W.float() + (B.float() @ A.float()) * scale) rounded once to W's dtype (the
    saved base values and the float32 deltas live in one buffer each); back to the base bit for bit.
    With ROLLFLEET_SYNC_TIMING each merge logs its phases."""
    from rollfleet.engine.lora import lora_merge
    from rollfleet.engine.model.model import ModelRunner

    monkeypatch.setattr(lora_merge, "SYNC_TIMING", True)

    runner = ModelRunner(qwen3_dir, dtype=dtype, lora=LoraLimits())
    params = runner.lora._params
    base = {n: p.detach().clone() for n, p in params.items()}
    for name, targets in [("attn", ATTENTION), ("mlp", ["gate_proj", "down_proj", "lm_head"])]:
        make_adapter(qwen3_dir, targets).save_pretrained(tmp_path / name, save_embedding_layers=False)
        runner.lora.load(name, str(tmp_path / name))
    for name in ["attn", "mlp", "attn", None]:  # each merge starts from the base, of other shapes each time
        runner.lora.use(name)
        merged = {f"{t.module}.weight": t for t in runner.lora.adapters[name].targets} if name else {}
        assert len(merged) == {None: 0, "attn": 8, "mlp": 5}[name]  # 2 layers; lm_head once
        for key, param in params.items():
            target = merged.get(key)
            want = (
                base[key]
                if target is None
                else (base[key].float() + (target.lora_b.float() @ target.lora_a.float()) * target.scale).to(dtype)
            )
            assert torch.equal(param, want), (name, key)
    merges = [r.getMessage() for r in caplog.records if "lora merge of" in r.getMessage()]
    phases = re.compile(r"targets [0-9.]+ms \(earlier=.* to_device=.* targets=.*; thread cpu=[0-9.]+ms\)")
    assert len(merges) == 3 and all(phases.search(m) for m in merges), merges


def test_host_copies_of_an_adapter_share_nothing_with_the_bucket():
    tensors = [(f"w{i}", torch.randn(8, 4).to(torch.bfloat16 if i % 2 else torch.float32)) for i in range(6)]
    bucket = PackPlan(tensors).pack(tensors, torch.empty(call_bytes(tensors), dtype=torch.uint8))
    views = {**bucket.unpack(), "strided": torch.arange(12.0)[::3], "empty": torch.zeros(0, 3)}
    for per_storage in (True, False):  # one copy of the bucket's bytes (a GPU's adapter), or a clone each (CPU)
        owned = host_copies(views, per_storage=per_storage)
        assert all(torch.equal(owned[k], v) for k, v in views.items())
        assert bucket.flattened_tensor.untyped_storage().data_ptr() not in {
            t.untyped_storage().data_ptr() for t in owned.values()
        }
        assert len({owned[k].untyped_storage().data_ptr() for k, _ in tensors}) == (1 if per_storage else 6)
    bucket.flattened_tensor.fill_(0)  # the sender reuses its buffer: the copies keep their values
    assert all(torch.equal(owned[k], t) for k, t in tensors)


def test_adapter_fingerprints_taken_at_load_are_the_stored_tensors(qwen3_dir):
    """The engine samples an adapter where it arrived (one gather at load) and answers verify from those
    samples: the same fingerprints as the stored copies', after the sender's buffer changed too."""
    source = LoraSource(make_adapter(qwen3_dir, ATTENTION))
    sent = [(k, t.detach().clone()) for k, t in source.named_tensors()]
    bucket = PackPlan(sent).pack(sent, torch.empty(call_bytes(sent), dtype=torch.uint8))
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    targets = lora_targets(model, dict(model.named_parameters(remove_duplicate=False)))
    parsed = parse_adapter("p", TENSORS_PATH, source.config_dict(), bucket.unpack(), model, targets, LoraLimits())
    bucket.flattened_tensor.fill_(0)  # the sender reuses its buffer before anyone verifies
    want = fingerprints(sent)
    assert parsed.fingerprints(None, DEFAULT_SAMPLES) == want == fingerprints(parsed.tensors.items())
    some = sorted(want)[1:4]
    assert parsed.fingerprints(some, DEFAULT_SAMPLES) == {k: want[k] for k in some}
    assert (
        parsed.fingerprints(some, 7)
        == fingerprints(((k, dict(sent)[k]) for k in some), samples=7)
        != {k: want[k] for k in some}
    )
    with pytest.raises(LoraError, match="not in adapter"):
        parsed.fingerprints(["base_model.model.nope.lora_A.weight"], DEFAULT_SAMPLES)


def test_lora_flags_and_config(tmp_path):
    parser = build_parser()
    with pytest.raises(SystemExit):
        check_args(parser, parser.parse_args(["--model-path", "m", "--max-lora-rank", "8"]))
    args = parser.parse_args(["--model-path", "m", "--enable-lora", "--lora-target-modules", "q_proj", "v_proj"])
    check_args(parser, args)
    assert transport_class(LoraSync()).server_args(LoraSync(lora_target_modules=["q_proj"])) == [
        "--enable-lora",
        "--max-lora-rank",
        "64",
        "--lora-target-modules",
        "q_proj",
    ]
    assert transport_class(TensorSync()).server_args(TensorSync()) == []  # full-weight transports need none
    assert json.dumps(LoraSync().model_dump())
