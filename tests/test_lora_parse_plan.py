"""An engine's adapter plans (rollfleet.engine.lora.parse_plan): a LoRA sender that packs every version
into the same buffer gets the same tensors back on the engine (BucketViews), whose parse is then the
plan's; what it gives is what `parse_adapter` gives for the new values, and anything else (another
config, other limits, another buffer) is parsed in full, its refusals unchanged. Payloads cross as
a sender sends them (a reused shared-memory buffer, serialize / safe_loads)."""

from __future__ import annotations

import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from rollfleet.engine.lora.lora import LoraError, LoraLimits, parse_adapter
from rollfleet.engine.lora.parse_plan import AdapterPlans
from rollfleet.engine.model.model import ModelRunner
from rollfleet.weights.adapter import LoraSource
from rollfleet.weights.transports.staging import PackPlan
from rollfleet.wire.fingerprint import fingerprints
from rollfleet.wire.serialize import serialize, use_file_system_sharing

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Sender:
    """A LoRA sender that packs each version into its one shared-memory buffer (the lora transport
    with engines that copy adapters at load), from a peft model it steps between versions."""

    def __init__(self, model_dir: str, dtype=torch.float32):
        use_file_system_sharing()
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        self.source = LoraSource(self.peft)
        tensors = list(self.source.named_tensors())
        self.plan = PackPlan(tensors)
        self.buffer = torch.empty(self.plan.nbytes, dtype=torch.uint8).share_memory_()

    def version(self, seed: int) -> tuple[list[str], dict, dict[str, torch.Tensor]]:
        """(the serialized entry, the config, the values sent) of a new version."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.peft.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        tensors = list(self.source.named_tensors())
        wire = serialize(self.plan.pack(tensors, self.buffer).to_payload())
        return [wire], self.source.config_dict(), {name: t.detach().clone() for name, t in tensors}


def _slow(runner: ModelRunner, name: str, config: dict, tensors: dict, limits: LoraLimits | None = None):
    lora = runner.lora
    return parse_adapter(name, "__tensor__", config, tensors, lora._model, lora.targetable, limits or lora.limits)


def _same_adapter(got, want) -> bool:
    return (
        list(got.tensors) == list(want.tensors)
        and all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
        and [(t.module, t.scale) for t in got.targets] == [(t.module, t.scale) for t in want.targets]
        and all(
            torch.equal(a.lora_a, b.lora_a) and torch.equal(a.lora_b, b.lora_b)
            for a, b in zip(got.targets, want.targets)
        )
        and got.fingerprints(None, 4096) == want.fingerprints(None, 4096)
    )


@pytest.fixture(scope="module")
def runner(qwen3_dir):
    return ModelRunner(qwen3_dir, lora=LoraLimits())


def test_versions_in_the_same_buffer_are_parsed_by_the_plan_and_hold_what_was_sent(runner, qwen3_dir):
    sender = Sender(qwen3_dir)
    lora = runner.lora
    hits = lora.plans.hits
    for version in range(4):
        entry, config, sent = sender.version(version)
        lora.load(f"v{version}", None, config, entry, "flattened_bucket")
        adapter = lora.adapters[f"v{version}"]
        assert _same_adapter(adapter, _slow(runner, "ref", config, sent))
        assert adapter.fingerprints(None, 4096) == fingerprints(sent.items())  # what the sender verifies against
        buffer = (sender.buffer.data_ptr(), sender.buffer.data_ptr() + sender.buffer.nbytes)
        assert all(not buffer[0] <= t.data_ptr() < buffer[1] for t in adapter.tensors.values())  # owned copies
    # the first two versions were parsed in full (the second showed the buffer reused), the next two by the plan
    assert lora.plans.hits == hits + 2
    before = {k: t.clone() for k, t in lora.adapters["v3"].tensors.items()}
    sender.version(99)  # the sender packs the next version into the buffer: what was loaded stays
    assert all(torch.equal(t, before[k]) for k, t in lora.adapters["v3"].tensors.items())
    for version in range(4):
        lora.unload(f"v{version}")


def test_another_config_or_limits_are_parsed_in_full_with_their_refusals(runner, qwen3_dir):
    sender = Sender(qwen3_dir)
    lora = runner.lora
    entry, config, sent = sender.version(1)
    lora.load("a", None, config, entry, "flattened_bucket")
    entry, _, sent = sender.version(2)
    hits = lora.plans.hits
    lora.load("b", None, {**config, "lora_alpha": 2}, entry, "flattened_bucket")  # another scale: a full parse
    assert lora.plans.hits == hits
    assert {t.scale for t in lora.adapters["b"].targets} == {2 / 4}
    assert _same_adapter(lora.adapters["b"], _slow(runner, "ref", {**config, "lora_alpha": 2}, sent))
    entry, _, _ = sender.version(3)
    with pytest.raises(LoraError, match="rank 4 differs from the config's r=8"):
        lora.load("c", None, {**config, "r": 8}, entry, "flattened_bucket")
    plans, tensors = AdapterPlans(), lora._views.unpack(lora._held_payload)
    for _ in range(2):  # parsed in full twice, the second time in the same storage: a plan
        plans.parse("d", config, tensors, lora._model, lora.targetable, lora.limits)
    assert plans.plan is not None
    with pytest.raises(LoraError, match="rank 4 > --max-lora-rank 2"):  # the same tensors under other limits
        plans.parse("d", config, tensors, lora._model, lora.targetable, LoraLimits(max_rank=2))
    assert "c" not in lora.adapters
    lora.unload("a"), lora.unload("b")


def test_a_plan_lets_its_buffer_go_when_another_buffer_comes(runner, qwen3_dir):
    lora = runner.lora
    first, second = Sender(qwen3_dir), Sender(qwen3_dir)
    for version in ("a", "a2"):
        entry, config, _ = first.version(1)
        lora.load(version, None, config, entry, "flattened_bucket")
    assert lora.plans.plan is not None
    held = weakref.ref(lora.plans.plan.sources[0])
    entry, config, sent = second.version(2)
    hits = lora.plans.hits
    lora.load("b", None, config, entry, "flattened_bucket")
    assert lora.plans.hits == hits and held() is None  # parsed in full; the first buffer's views are gone
    assert _same_adapter(lora.adapters["b"], _slow(runner, "ref", config, sent))
    lora.unload("a"), lora.unload("a2"), lora.unload("b")


def test_a_sender_with_a_fresh_buffer_each_time_gets_no_plan(runner, qwen3_dir):
    """A plan costs about a full parse: a load whose tensors are not in the last one's storage makes none."""
    lora = runner.lora
    for version in range(3):
        entry, config, sent = Sender(qwen3_dir).version(version)  # a new buffer each time
        lora.load(f"f{version}", None, config, entry, "flattened_bucket")
        assert lora.plans.plan is None
        assert _same_adapter(lora.adapters[f"f{version}"], _slow(runner, "ref", config, sent))
    for version in range(3):
        lora.unload(f"f{version}")
