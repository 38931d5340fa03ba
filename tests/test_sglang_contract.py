"""Contract test against SGLang's own code (`make sglang-site` installs the pinned wheel into
.sglang-site; `make test` runs it first). tests/sglang_harness.py serves SGLang's receiving path
(its request structs, payload normalisation, scheduler and tp-worker weight updaters, model-runner
WeightUpdater with the gloo group) with a recording model; every rollfleet transport sends to it
and what SGLang's code hands the model must be bit-exact. The other way, SGLang's own client payloads
(FlattenedTensorBucket + MultiprocessingSerializer, its request structs as JSON) must load into
the embedded engine bit-exact. Skipped, with the reason, only when the wheel is not installed."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from rollfleet.config import DiskSync, LoraSync, NcclSync, TensorSync, load_config
from rollfleet.config.lora import engine_sync_spec
from rollfleet.fleet.colocation import RESUME_AFTER_PUSH, release_tags
from rollfleet.fleet.sampling_seeds import derive_seed, seeded_payload
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.transports.base import EngineTarget, make_transport
from rollfleet.weights.transports.lora import LoraTransport
from rollfleet.wire.client import SUPPORTED_SGLANG, EngineClient, UnsupportedEngine, check_supported
from tests.conftest import call

ROOT = Path(__file__).resolve().parent.parent
# another release's site (pip install --no-deps --target DIR sglang==X plus requirements-sglang.txt's
# other pins) is tried with ROLLFLEET_SGLANG_SITE=DIR; CI runs the pinned one in .sglang-site
SITE = Path(os.environ.get("ROLLFLEET_SGLANG_SITE") or ROOT / ".sglang-site").resolve()
START_TIMEOUT_S = 300  # importing SGLang's modules on a loaded 2-core machine


def sglang_env() -> dict[str, str]:
    """The environment of a process that runs SGLang's code (skips the test without the wheel)."""
    if not (SITE / "sglang" / "version.py").exists():
        if os.environ.get("ROLLFLEET_SGLANG_SITE"):
            raise FileNotFoundError(f"ROLLFLEET_SGLANG_SITE={SITE} holds no sglang package (install one there)")
        pytest.skip(f"the sglang wheel is not installed in {SITE}: run `make sglang-site` (needs the package registry)")
    return {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def sglang_url(tmp_path_factory):
    env = sglang_env()
    log = tmp_path_factory.mktemp("sglang") / "harness.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "sglang_harness.py")], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield f"http://127.0.0.1:{_listening_port(proc, log)}"
    finally:
        proc.kill()
        proc.wait(30)
        print(f"SGLang harness log: {log}\n{log.read_text()[-4000:]}")


def _listening_port(proc: subprocess.Popen, log: Path) -> int:
    """The port the harness printed, once it answers (its log's tail in the error otherwise)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        ports = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("LISTENING ")]
        if ports:
            try:
                httpx.get(f"http://127.0.0.1:{ports[0]}/get_server_info", timeout=5)
                return int(ports[0])
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    raise RuntimeError(f"the SGLang harness did not start: {log.read_text()[-3000:]}")


def describe(tensor: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the bytes], as the harness records what SGLang's code loaded."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), hashlib.sha256(data).hexdigest()]


class Named:
    """A WeightSource of fixed tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def named_tensors(self):
        yield from self.tensors.items()


def _weights() -> dict[str, torch.Tensor]:
    """Mixed dtypes and odd sizes, two decoder layers: alignment and call splitting both matter."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": torch.randn(33, 8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(3, 5, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(9, 8, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.e_score_correction_bias": torch.randn(5, generator=g).to(torch.float64),
        "model.layers.1.self_attn.o_proj.weight": torch.randn(8, 9, generator=g).to(torch.float16),
    }


def _send(url: str, spec, version: str, source, **options) -> dict:
    httpx.post(f"{url}/contract/reset")
    target = EngineTarget(engine_id=0, url=url, num_ranks=1, rank_offset=1, dtype=torch.float32)
    transport = make_transport(spec, [target], **options)
    transport.connect()
    try:
        transport.send(source, version)
    finally:
        transport.disconnect()
    return httpx.get(f"{url}/contract/recorded").json()


@pytest.mark.parametrize("spec", [TensorSync(bucket_mb=0.0005), NcclSync(bucket_mb=0.0005)], ids=["tensor", "nccl"])
def test_rollfleet_transports_load_bit_exact_through_sglangs_own_updaters(sglang_url, spec):
    weights = _weights()
    options = {"device": "cpu"} if spec.transport == "nccl" else {}
    recorded = _send(sglang_url, spec, "v7", Named(weights), **options)
    assert recorded["weights"] == {name: describe(t) for name, t in weights.items()}
    assert recorded["versions"][-1] == "v7"  # in a session: each call carries the version


def _colocated_turn(url: str, release: list[str] | None, resumes: list[list[str]]) -> dict:
    """A colocated trainer turn's memory calls, as the fleet makes them, through SGLang's own release
    and resume (its bookkeeping raises on resuming a tag it did not release); what its memory saver saw."""

    async def turn():
        async with EngineClient(url) as client:
            await client.release_memory_occupation(release)
            for tags in resumes:
                await client.resume_memory_occupation(tags)

    before = len(httpx.get(f"{url}/contract/memory").json()["events"])
    asyncio.run(turn())
    seen = httpx.get(f"{url}/contract/memory").json()
    return {"events": seen["events"][before:], "released": seen["released"]}


@pytest.mark.parametrize("release_weights", [True, False])
def test_a_colocated_turn_resumes_every_tag_it_released_in_sglangs_order(sglang_url, release_weights):
    """The fleet's trainer turn (rollfleet.fleet.colocation) through SGLang's scheduler-side release and
    resume: nothing stays released (an unmapped CUDA graph pool would be read by the next replay), and
    the graphs come back before the KV cache, as slime resumes them."""
    resumes = ([["weights"]] if release_weights else []) + [RESUME_AFTER_PUSH]  # Fleet._push wakes weights
    seen = _colocated_turn(sglang_url, release_tags(release_weights), resumes)
    paused = [tag for verb, tag in seen["events"] if verb == "pause"]
    resumed = [tag for verb, tag in seen["events"] if verb == "resume"]
    assert sorted(paused) == sorted(resumed) == sorted(release_tags(release_weights))
    assert resumed[-2:] == ["cuda_graph", "kv_cache"] and seen["released"] in ([], None)
    # what the fleet did before: releasing everything and resuming only weights and the KV cache
    before = _colocated_turn(sglang_url, None, [["weights"], ["kv_cache"]])
    assert before["released"] in (["cuda_graph"], None)  # None: a release that keeps no record of tags
    httpx.post(f"{sglang_url}/resume_memory_occupation", json={"tags": ["cuda_graph"]}).raise_for_status()


def test_disk_transport_loads_bit_exact_through_sglangs_safetensors_reader(sglang_url, tmp_path):
    weights = _weights()
    recorded = _send(sglang_url, DiskSync(path=str(tmp_path)), "3", Named(weights))
    assert recorded["weights"] == {name: describe(t) for name, t in weights.items()}
    assert recorded["versions"] == ["3"]


def test_lora_transport_loads_one_bucket_dict_through_sglangs_tp_worker(sglang_url, qwen3_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(qwen3_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    source = LoraSource(peft_model)
    for version in ("2", "3"):  # each version a new name; the second sync finds the first where SGLang lists it
        recorded = _send(sglang_url, LoraSync(adapter_name="policy", path=str(tmp_path)), version, source)
        adapter = recorded["adapters"][f"policy-v{version}"]
        assert adapter["tensors"] == {name: describe(t) for name, t in source.named_tensors()}
        assert adapter["config"]["r"] == 4 and recorded["versions"] == [version]
        assert recorded["unloaded"] == ([] if version == "2" else ["policy-v2"])  # after the new one loaded
    cards = httpx.get(f"{sglang_url}/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [("policy-v3", "__tensor__", "recording")]


def test_sglangs_lora_adapter_needs_v_proj_beside_q_proj_as_the_config_says(sglang_url, qwen3_dir, tmp_path):
    """Why a LoRA run for SGLang engines refuses q_proj without v_proj (rollfleet/config/lora.py): SGLang
    0.5.23's LoRAAdapter stacks q, k and v and reads v unconditionally. If a later SGLang takes it, this
    fails, and the refusal can go."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for version, targets in enumerate((["q_proj"], ["q_proj", "v_proj"])):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
        source = LoraSource(get_peft_model(AutoModelForCausalLM.from_pretrained(qwen3_dir), config))
        recorded = _send(sglang_url, LoraSync(adapter_name="qv", path=str(tmp_path)), str(version + 1), source)
        parsed = recorded["adapters"][f"qv-v{version + 1}"]["parsed"]
        if targets == ["q_proj"]:
            assert parsed == {"error": "KeyError: 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight'"}
        else:
            assert all(any("qkv_proj" in name for name in names) for names in parsed["layer_weights"]), parsed


def test_an_embedding_adapter_reaches_sglangs_lora_adapter_as_peft_saved_it(sglang_url, qwen3_dir, tmp_path):
    """An adapter on embed_tokens as the lora transport sends it: SGLang's LoRAAdapter keeps its factors
    (peft's keys, lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r], bit for bit) among its
    embedding layers for its memory pool, the linear targets in their layers; and SGLang's own server
    arguments accept the engines' --lora-target-modules with embed_tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["embed_tokens", "q_proj", "v_proj"]  # SGLang stacks q with v (its normalize_qkv_proj needs v)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(qwen3_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    source = LoraSource(peft_model)
    sent = dict(source.named_tensors())
    recorded = _send(sglang_url, LoraSync(adapter_name="policy", path=str(tmp_path)), "1", source)
    parsed = recorded["adapters"]["policy-v1"]["parsed"]
    embedding = {k: describe(t) for k, t in sent.items() if "embed_tokens" in k}
    vocab, hidden = peft_model.get_input_embeddings().weight.shape
    assert parsed["embedding_layers"] == embedding and [shape for _, shape, _ in embedding.values()] == [
        [4, vocab],
        [hidden, 4],
    ]
    assert all(
        names == [f"base_model.model.model.layers.{i}.self_attn.qkv_proj.lora_{h}.weight" for h in "AB"]
        for i, names in enumerate(parsed["layer_weights"])
    )
    cfg = load_config(
        None, ["rollout.model_path=m", "weight_sync.transport=lora", f"train.lora.target_modules=[{','.join(targets)}]"]
    )
    flags = LoraTransport.server_args(engine_sync_spec(cfg))
    assert _in_sglang(SGLANG_FLAGS, json.dumps(flags)) == targets


def _in_sglang(code: str, *argv: str, stdin: str | None = None):
    """The last line of `code`'s output, as JSON, run by a Python that imports SGLang's own code."""
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        env=sglang_env(),
        cwd=ROOT,
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SGLANG_FLAGS = """
import argparse, json, sys
sys.path.insert(0, "tests")
import sglang_stubs  # noqa: F401  (before any sglang module)
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
print(json.dumps(parser.parse_args(["--model-path", "m", *json.loads(sys.argv[1])]).lora_target_modules))
"""


@pytest.mark.parametrize("load_format", ["flattened_bucket", "direct"])
def test_sglangs_own_client_payloads_load_into_the_embedded_engine_bit_exact(sglang_url, qwen3_server, load_format):
    layout = call(qwen3_server, "weight_layout")
    chosen = [
        [name, shape, "float32"] for name, shape, _ in layout["parameters"]
    ]  # a session commits only a complete update
    spec = {"url": qwen3_server.url, "tensors": chosen, "seed": 3, "load_format": load_format, "version": "sg1"}
    answer = httpx.post(f"{sglang_url}/contract/feed", json=spec, timeout=300)
    assert answer.status_code == 200, answer.text
    sent = answer.json()["fingerprints"]
    held = call(qwen3_server, "weights_fingerprint", [name for name, _, _ in chosen], samples=1 << 20)
    assert held == sent
    assert call(qwen3_server, "get_model_info")["weight_version"] == "sg1"


def test_an_sglang_release_outside_the_proven_range_is_refused_naming_the_range():
    low, high = (".".join(map(str, v)) for v in SUPPORTED_SGLANG)
    check_supported({"version": high})
    check_supported({"version": f"{low}.post1"})
    check_supported({"engine": "rollfleet-embedded", "rollfleet_weight_update_sessions": True, "version": "0.1"})
    for version in ("0.5.20", "0.6.0", "", None):
        with pytest.raises(UnsupportedEngine, match=f"{low} to {high}"):
            check_supported({"version": version}, "http://e")


SEEDED_REQUESTS = """
import json, sys
sys.path.insert(0, "tests")
import sglang_stubs  # noqa: F401  (before any sglang module)
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
out = []
for body in json.loads(sys.stdin.read()):
    request = GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
    params = [request.sampling_params] if isinstance(request.sampling_params, dict) else request.sampling_params
    for p in params:
        SamplingParams(**p).verify(100)  # raises on a seed SGLang refuses
    ids = [request.input_ids] if request.is_single else request.input_ids
    out.append({"input_ids": ids, "seeds": [p.get("sampling_seed") for p in params]})
print(json.dumps(out))
"""


def test_a_seeded_request_gives_each_sample_its_own_seed_in_sglangs_normalisation():
    """Why SGLang's seeded requests are sent one sample a copy (rollfleet.fleet.sampling_seeds): its
    own request normalisation hands a request's n copies one seed (so they would draw the same tokens),
    and our per-sample form reaches it as n requests of the prompt with our n seeds, in order, each a
    seed its SamplingParams accept."""
    request = {"input_ids": [5, 6, 7], "sampling_params": {"n": 4, "max_new_tokens": 3}, "return_logprob": True}
    plain = seeded_payload(request, 2**63 - 1, each_sample=False)
    each = seeded_payload(request, derive_seed(0, 17), each_sample=True)
    shared, own = _in_sglang(SEEDED_REQUESTS, stdin=json.dumps([plain, each]))
    assert shared == {"input_ids": [[5, 6, 7]] * 4, "seeds": [2**63 - 1] * 4}
    assert own["input_ids"] == [[5, 6, 7]] * 4
    assert own["seeds"] == [p["sampling_seed"] for p in each["sampling_params"]] and len(set(own["seeds"])) == 4


# (call, tags, refused by SGLang 0.5.23's bookkeeping): each refusal fails on its first tag, so that
# SGLang's record (it removes tag by tag) is left unchanged as the embedded engine's is
MEMORY_STEPS = [
    ("resume", ["kv_cache"], True),  # nothing released
    ("release", ["kv_cache"], False),
    ("resume", ["weights"], True),  # another tag than the one released
    ("resume", ["kv_cache"], False),
    ("release", None, False),  # all tags
    ("resume", ["weights"], False),
    ("resume", ["weights"], True),
    ("resume", ["cuda_graph", "kv_cache"], False),
    ("release", None, False),  # XTuner's cycle: all tags released, weights and kv_cache resumed
    ("resume", ["weights"], False),
    ("resume", ["kv_cache"], False),
    ("release", None, False),  # its next step: cuda_graph is released already (a set: accepted)
    ("release", ["kv_cache"], False),  # a tag released twice
    ("resume", ["kv_cache"], False),
    ("resume", None, True),  # kv_cache is not released any more
    ("resume", ["cuda_graph", "weights"], False),
]


def test_release_and_resume_state_matches_sglangs_own_bookkeeping(sglang_url, qwen3_server):
    """The embedded engine refuses (400, nothing changed) exactly the resumes SGLang's scheduler-side
    manager raises on, accepts the releases it accepts (a tag already released included: its record
    is a set), and records the same released tags after every call."""
    for verb, tags, sglang_refuses in MEMORY_STEPS:
        route = f"/{verb}_memory_occupation"
        theirs = httpx.post(sglang_url + route, json={"tags": tags}, timeout=60)
        ours = httpx.post(qwen3_server.url + route, json={"tags": tags}, timeout=60)
        assert (theirs.status_code != 200) == sglang_refuses, (verb, tags, theirs.text[:300])
        assert ours.status_code == (400 if sglang_refuses else 200), (verb, tags, ours.text)
        released = httpx.get(f"{sglang_url}/contract/memory").json()["released"]
        assert call(qwen3_server, "get_server_info")["rollfleet_released_memory"] == released, (verb, tags)
