"""Weight sync end to end on CPU: a trainer-side source pushed into live engines of a Ray fleet over
tensor (shared memory), nccl (gloo) and disk; verified by fingerprint; bad updates change nothing."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import every_engine, reference_greedy
from transformers import AutoModelForCausalLM

from rollfleet.config import DiskSync, NcclSync, TensorSync, load_config
from rollfleet.fleet.fleet import Fleet
from rollfleet.weights.source import ModuleSource

# 0.1 MiB buckets: a tiny model (0.46 MB) takes several calls, so bucketing and pipelining are exercised
TRANSPORTS = {"tensor": TensorSync(bucket_mb=0.1), "nccl": NcclSync(bucket_mb=0.1, join_timeout_s=30)}
# one bucket: an update is all or nothing per request, so a bad tensor must share the only bucket
ONE_BUCKET = {"tensor": TensorSync(), "nccl": NcclSync(join_timeout_s=30)}
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def running_fleet(model_dir, log_dir, *overrides):
    """A fleet for a module fixture (`yield from`): shut down when the module ends."""
    cfg = load_config(
        None, [f"rollout.model_path={model_dir}", "rollout.use_gpu=true", f"rollout.log_dir={log_dir}", *overrides]
    )
    fleet = Fleet.from_config(cfg)
    try:
        yield fleet
    finally:
        fleet.shutdown()


@pytest.fixture(scope="module")
def dense_fleet(local_ray, qwen3_dir, tmp_path_factory):
    yield from running_fleet(qwen3_dir, tmp_path_factory.mktemp("logs"), "rollout.num_engines=2")


@pytest.fixture(scope="module")
def moe_fleet(local_ray, moe_dir, tmp_path_factory):
    yield from running_fleet(moe_dir, tmp_path_factory.mktemp("logs"), "rollout.tp_size=2", "rollout.ep_size=2")


def transport(name, tmp_path):
    return DiskSync(path=str(tmp_path / "sync")) if name == "disk" else TRANSPORTS[name]


def greedy(fleet):
    samples = fleet.generate(PROMPTS, sampling=GREEDY)
    return [s.output_ids for s in samples], {s.weight_version for s in samples}


@pytest.mark.parametrize("name", ["tensor", "nccl", "disk"])
def test_dense_sync_to_two_engines(dense_fleet, qwen3_dir, qwen3_dir_b, name, tmp_path):
    for version, model_dir in ((f"{name}-b", qwen3_dir_b), (f"{name}-a", qwen3_dir)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        options = {"config_dir": qwen3_dir} if name == "disk" else {}
        report = dense_fleet.sync_weights(ModuleSource(model), version, transport=transport(name, tmp_path), **options)
        assert report.tensors == len(dict(model.named_parameters())) and sorted(report.fingerprints) == [0, 1]
        outputs, versions = greedy(dense_fleet)
        assert versions == {version}
        assert outputs == [reference_greedy(model_dir, p, 8)[0] for p in PROMPTS]


def test_moe_fleet_tp2_ep2_generates(moe_fleet):
    """Before any sync: n samples per prompt, in order, each with its logprobs (from test_fleet, on
    this module's MoE fleet rather than one of its own)."""
    samples = moe_fleet.generate([[1, 2, 3], [4, 5]], n=4, sampling={"max_new_tokens": 5, "ignore_eos": True})
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, k) for p in range(2) for k in range(4)]
    assert all(len(s.output_ids) == 5 == len(s.logprobs) for s in samples)


@pytest.mark.parametrize("name", ["tensor", "nccl", "disk"])
def test_moe_sync_into_tp2_ep2(moe_fleet, moe_dir, moe_dir_b, name, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(moe_dir_b, dtype=torch.float32)
    options = {"config_dir": moe_dir} if name == "disk" else {}
    report = moe_fleet.sync_weights(ModuleSource(model), f"moe-{name}", transport=transport(name, tmp_path), **options)
    assert any(".experts.3.up_proj.weight" in n for n in report.fingerprints[0])  # per-expert names travel
    outputs, versions = greedy(moe_fleet)
    assert versions == {f"moe-{name}"}
    assert outputs == [reference_greedy(moe_dir_b, p, 8)[0] for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    moe_fleet.sync_weights(ModuleSource(model), "moe-back", transport=TRANSPORTS["tensor"])


def test_sync_to_a_subset_of_engines(dense_fleet, qwen3_dir, qwen3_dir_b):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
    report = dense_fleet.sync_weights(ModuleSource(model), "only-1", engine_ids=[1], transport=TRANSPORTS["nccl"])
    assert report.engine_ids == [1]
    versions = [info["weight_version"] for info in every_engine(dense_fleet, "get_model_info")]
    assert versions[1] == "only-1" and versions[0] != "only-1"
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    dense_fleet.sync_weights(ModuleSource(model), "both", transport=TRANSPORTS["tensor"])


class RenamedSource:
    """A source that sends one tensor under a wrong name or with a wrong shape."""

    def __init__(self, model, bad):
        self.inner, self.bad = ModuleSource(model), bad

    def named_tensors(self):
        for index, (name, tensor) in enumerate(self.inner.named_tensors()):
            yield (self.bad(name, tensor) if index == 3 else (name, tensor))


@pytest.mark.parametrize("name", ["tensor", "nccl"])
@pytest.mark.parametrize(
    "bad",
    [lambda n, t: ("model.layers.0.not_a_weight", t), lambda n, t: (n, t[:-1])],
    ids=["unknown-name", "wrong-shape"],
)
def test_bad_update_changes_nothing(dense_fleet, qwen3_dir_b, name, bad):
    before = every_engine(dense_fleet, "shard_fingerprints")
    versions = [info["weight_version"] for info in every_engine(dense_fleet, "get_model_info")]
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
    with pytest.raises(Exception) as err:
        dense_fleet.sync_weights(RenamedSource(model, bad), "bad", transport=ONE_BUCKET[name])
    assert "not_a_weight" in str(err.value) or "shape" in str(err.value)
    assert every_engine(dense_fleet, "shard_fingerprints") == before
    assert [info["weight_version"] for info in every_engine(dense_fleet, "get_model_info")] == versions


class LastLayerWrong:
    """A source whose last decoder layer carries one tensor of a wrong shape: with small buckets the
    refusal comes in a late call, while earlier calls were sent (and later ones packed) already."""

    def __init__(self, model):
        self.inner = ModuleSource(model)

    def named_tensors(self):
        for name, tensor in self.inner.named_tensors():
            yield (name, tensor[:-1]) if name.endswith("layers.1.mlp.down_proj.weight") else (name, tensor)


@pytest.mark.parametrize("name", ["tensor", "nccl", "nccl-one-call-at-a-time"])
def test_refused_late_call_leaves_transport_usable(dense_fleet, qwen3_dir, qwen3_dir_b, name):
    """A pipelined sync refused in a late call raises naming the tensor, drains what was in flight,
    and the same connected transport (the same NCCL group) then delivers a good sync."""
    from rollfleet.weights.transports import make_transport

    transport = make_transport(TRANSPORTS[name.split("-")[0]], dense_fleet.weight_targets(), timeout_s=60)
    transport.connect()
    if name.startswith("nccl"):
        assert transport.calls_ahead == 2  # embedded engines run numbered calls in order
    if name == "nccl-one-call-at-a-time":
        transport.calls_ahead = 1  # what engines that do not (SGLang) get: unnumbered calls, one in flight
    try:
        bad = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
        with pytest.raises(Exception, match="layers.1.mlp.down_proj.weight"):
            transport.send(LastLayerWrong(bad), "refused")
        assert {info["weight_version"] for info in every_engine(dense_fleet, "get_model_info")} != {"refused"}
        good = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
        report = transport.send(ModuleSource(good), f"after-refusal-{name}")
        assert report.buckets > 2  # several calls: the refusal above was not in the first one
    finally:
        transport.disconnect()
    dense_fleet.verify(report)
    outputs, versions = greedy(dense_fleet)
    assert versions == {f"after-refusal-{name}"}
    assert outputs == [reference_greedy(qwen3_dir, p, 8)[0] for p in PROMPTS]


def test_version_mode_checks_versions_only(dense_fleet, qwen3_dir):
    """verify=version (SGLang engines) catches a wrong version but, unlike fingerprints, not wrong tensors."""
    import asyncio

    from rollfleet.weights.verify import find_unverified
    from rollfleet.wire.client import EngineClient

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    report = dense_fleet.sync_weights(ModuleSource(model), "checked", transport=TRANSPORTS["tensor"])
    name = next(iter(report.fingerprints[0]))
    tampered = dataclasses.replace(
        report, fingerprints={e: {**f, name: "0" * 24} for e, f in report.fingerprints.items()}
    )
    stale = dataclasses.replace(report, version="not-sent")
    left_out = dataclasses.replace(  # as if the push had not sent `name`: the engine holds a tensor not sent
        report, fingerprints={e: {n: v for n, v in f.items() if n != name} for e, f in report.fingerprints.items()}
    )

    async def problems(checked, mode):
        clients = {s.engine_id: EngineClient(s.url) for s in dense_fleet.slots}
        try:
            return await find_unverified(checked, clients, mode)
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()))

    assert asyncio.run(problems(report, "fingerprint")) == {} == asyncio.run(problems(report, "version"))
    assert set(asyncio.run(problems(tampered, "fingerprint"))) == {0, 1}
    left_out_problems = asyncio.run(problems(left_out, "fingerprint"))
    assert set(left_out_problems) == {0, 1} and all("not sent" in p and name in p for p in left_out_problems.values())
    assert asyncio.run(problems(tampered, "version")) == {}  # the weaker check
    assert set(asyncio.run(problems(stale, "version"))) == {0, 1}


class CopiedSource(ModuleSource):
    """A source that yields one tensor as a copy (as a conversion that copies would)."""

    def named_tensors(self, **kwargs):
        for index, (name, tensor) in enumerate(super().named_tensors(**kwargs)):
            yield (name, tensor.clone()) if index == 2 else (name, tensor)


def test_resident_push_maps_the_parameters_once_then_sends_an_id(dense_fleet, qwen3_dir, qwen3_dir_b):
    """A one-rank sender whose parameters stay (ModuleSource(stays=True)) maps them into both engines at
    its first push; later pushes send the mapping's id and the engines load the parameters' current
    values; a new storage, another sender's mapping in between, or a source whose tensors are not all
    parameters each send tensors again (or pack), and every push is verified and served."""
    from rollfleet.weights.transports import make_transport

    def sender():
        made = make_transport(TensorSync(), dense_fleet.weight_targets(), timeout_s=60)
        made.connect()
        return made

    def push(transport, source, version, model_dir):
        report = transport.send(source, version)
        dense_fleet.verify(report)
        outputs, versions = greedy(dense_fleet)
        assert versions == {version}
        assert outputs == [reference_greedy(model_dir, p, 8)[0] for p in PROMPTS]
        return report.resident

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    first, second = sender(), sender()
    try:
        assert push(first, ModuleSource(model, stays=True), "resident-1", qwen3_dir_b) == "mapped to engines [0, 1]"
        with torch.no_grad():  # the trainer's step: the same storages, new values
            for mine, theirs in zip(model.parameters(), other.parameters()):
                mine.copy_(theirs)
        assert push(first, ModuleSource(model, stays=True), "resident-2", qwen3_dir) == "kept"
        back = AutoModelForCausalLM.from_pretrained(qwen3_dir_b, dtype=torch.float32)
        assert push(second, ModuleSource(back, stays=True), "resident-3", qwen3_dir_b) == "mapped to engines [0, 1]"
        assert push(first, ModuleSource(model, stays=True), "resident-4", qwen3_dir) == "mapped to engines [0, 1]"
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # a new storage: the mapping is stale
        assert push(first, ModuleSource(model, stays=True), "resident-5", qwen3_dir) == "mapped to engines [0, 1]"
        assert push(first, ModuleSource(model, stays=True), "resident-6", qwen3_dir) == "kept"
        assert push(first, ModuleSource(model), "resident-7", qwen3_dir) is None  # may move: packed
        packed = push(first, CopiedSource(back, stays=True), "resident-8", qwen3_dir_b)
        assert packed.startswith("packed: 1 tensors are not parameters")
    finally:
        first.disconnect(), second.disconnect()


def test_a_resident_id_the_engine_does_not_hold_is_refused_and_changes_nothing(dense_fleet, qwen3_dir):
    from rollfleet.wire.serialize import serialize

    before = every_engine(dense_fleet, "shard_fingerprints")
    client = dense_fleet.pool
    client.call(0, "begin_weight_update")
    for payload, says in (
        ({"mapping": "never-sent", "tensors": None}, "mapping 'never-sent' is not held by this engine"),
        (["not", "a", "mapping"], "expects each entry to be {'mapping': id, 'tensors': pairs or None}"),
        ({"mapping": "", "tensors": None}, "must be a string of 1 to 64 characters"),
    ):
        with pytest.raises(Exception, match=re.escape(says)) as err:
            client.call(0, "update_weights_from_tensor", [serialize(payload)], load_format="rollfleet_resident")
        assert "400" in str(err.value)
    with pytest.raises(Exception, match="refused"):
        client.call(0, "end_weight_update")  # the session saw a refusal: nothing is committed
    assert every_engine(dense_fleet, "shard_fingerprints") == before
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    dense_fleet.sync_weights(ModuleSource(model), "after-refused-id", transport=TRANSPORTS["tensor"])


def test_resident_push_into_tp2_ep2(moe_fleet, moe_dir, moe_dir_b):
    """A MoE sender asking for the resident path: transformers' conversion to per-expert checkpoint
    tensors copies the gate/up halves out of the fused parameters, so the push says why it packed,
    and the tp=2 ep=2 engines load it as before."""
    from rollfleet.weights.transports import make_transport

    model = AutoModelForCausalLM.from_pretrained(moe_dir_b, dtype=torch.float32)
    transport = make_transport(TensorSync(), moe_fleet.weight_targets(), timeout_s=60)
    transport.connect()
    try:
        residents = []
        for version, model_dir in (("moe-resident-b", moe_dir_b), ("moe-resident-a", moe_dir)):
            with torch.no_grad():
                fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                for mine, theirs in zip(model.parameters(), fresh.parameters()):
                    mine.copy_(theirs)
            report = transport.send(ModuleSource(model, stays=True), version)
            moe_fleet.verify(report)
            residents.append(report.resident)
            outputs, versions = greedy(moe_fleet)
            assert versions == {version}
            assert outputs == [reference_greedy(model_dir, p, 8)[0] for p in PROMPTS]
    finally:
        transport.disconnect()
    assert all(r.startswith("packed: 16 tensors are not parameters (model.layers.0.mlp.experts.0.") for r in residents)
