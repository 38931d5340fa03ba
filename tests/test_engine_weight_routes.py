"""Weight sync into real engine processes, driven the way a sender written for SGLang drives it.

Tensor route: per-rank payloads of flattened buckets pickled with ForkingPickler (CPU shared
memory). Distributed route: this test process is group rank 0, joins with SGLang's own recipe
(rendezvous + PrefixStore + `_new_process_group_helper`, gloo) while the engine joins over HTTP,
and broadcasts what the HTTP call announces. After a sync, greedy tokens equal a plain forward
pass of the new checkpoint and every rank's shards equal those of a server started from it;
refused updates change nothing and leave the group usable.
"""

from __future__ import annotations

import base64
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import call, reference_greedy
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from rollfleet.wire.buckets import dtype_name, iter_buckets
from rollfleet.wire.client import EngineError
from rollfleet.wire.net import free_port
from rollfleet.wire.serialize import serialize

PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
BUCKET_BYTES = 48 * 1024  # the tiny models then need several buckets, one of them oversize


@pytest.fixture(scope="module")
def servers(weight_servers):
    """conftest's weight_servers (shared with test_engine_tp): targets tp1 / tp2 start from dummy
    weights, moe from moe_dir; ref1 / ref2 started from qwen3_dir_b. Each test first loads what it needs."""
    return weight_servers


def tp_of(key: str) -> int:
    return 2 if key in ("tp2", "moe") else 1


def greedy(proc) -> list[list[int]]:
    return [o["output_ids"] for o in call(proc, "generate", input_ids=PROMPTS, sampling_params=GREEDY)]


def expected(model_dir) -> list[list[int]]:
    return [reference_greedy(model_dir, prompt, GREEDY["max_new_tokens"])[0] for prompt in PROMPTS]


def checkpoint(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def state(proc) -> tuple:
    return call(proc, "shard_fingerprints"), call(proc, "get_model_info")["weight_version"]


def push_tensors(proc, tp: int, buckets, **kwargs):
    """One call: every rank gets its own payload (its own shared-memory handles) of all the buckets."""
    payloads = [serialize([b.to_payload() for b in buckets]) for _ in range(tp)]
    return call(proc, "update_weights_from_tensor", payloads, load_format="flattened_bucket", **kwargs)


# ---- tensor route ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["tp1", "tp2"])
def test_tensor_route_flattened_buckets_give_the_new_checkpoint(servers, key, qwen3_dir, qwen3_dir_b):
    engine, tp = servers[key], tp_of(key)
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    assert greedy(engine) != expected(qwen3_dir_b)  # the push below has something to change
    buckets = list(iter_buckets(checkpoint(qwen3_dir_b).items(), BUCKET_BYTES))
    assert len(buckets) >= 3
    half = len(buckets) // 2
    assert push_tensors(engine, tp, buckets[:half])["success"] is True  # a partial push: version stays
    assert call(engine, "get_model_info")["weight_version"] == "a"
    push_tensors(engine, tp, buckets[half:], weight_version="tensor-b")
    assert greedy(engine) == expected(qwen3_dir_b)
    prints, version = state(engine)
    assert version == "tensor-b" and len(prints) == tp
    assert prints == call(servers[f"ref{tp}"], "shard_fingerprints")


def test_tensor_route_direct_pairs(servers, qwen3_dir, qwen3_dir_b):
    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir)
    pairs = list(checkpoint(qwen3_dir_b).items())
    payloads = [serialize(pairs) for _ in range(2)]
    call(engine, "update_weights_from_tensor", payloads, load_format="direct", weight_version="direct-b")
    assert call(engine, "shard_fingerprints") == call(servers["ref2"], "shard_fingerprints")


def test_tensor_route_verl_local_serialized_tensors(servers, qwen3_dir, qwen3_dir_b, monkeypatch):
    """verl's payload (sglang.srt.weight_sync.utils.update_weights): every tensor wrapped in SGLang's
    LocalSerializedTensor with one value per tp rank, the pair list serialized once per rank."""
    import dataclasses
    import io
    import sys
    import types
    from multiprocessing.reduction import ForkingPickler

    module = "sglang.srt.model_executor.model_runner_components.weight_updater"
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # SGLang's class name in this process only: the engine has no SGLang
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    @dataclasses.dataclass
    class LocalSerializedTensor:  # SGLang's: values[i] is tp rank i's serialized tensor
        values: list

    LocalSerializedTensor.__module__, LocalSerializedTensor.__qualname__ = module, "LocalSerializedTensor"
    sys.modules[module].LocalSerializedTensor = LocalSerializedTensor

    def raw(obj) -> bytes:  # MultiprocessingSerializer.serialize
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(obj)
        return buffer.getvalue()

    def verl_payloads(tensors: dict, ranks: int) -> list[str]:
        wrapped = [(name, LocalSerializedTensor([raw(t) for _ in range(ranks)])) for name, t in tensors.items()]
        return [base64.b64encode(raw(wrapped)).decode() for _ in range(2)]

    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    before = state(engine)
    tensors = checkpoint(qwen3_dir_b)
    with pytest.raises(EngineError) as err:  # one value for two ranks: rank 1 has none, nothing applies
        call(engine, "update_weights_from_tensor", verl_payloads(tensors, 1), weight_version="bad")
    assert err.value.status_code == 400 and "tp rank 1 has none" in err.value.message, err.value.message
    assert state(engine) == before
    call(engine, "update_weights_from_tensor", verl_payloads(tensors, 2), weight_version="verl-b")
    assert state(engine) == (call(servers["ref2"], "shard_fingerprints"), "verl-b")


def test_bad_tensor_updates_change_nothing(servers, qwen3_dir, qwen3_dir_b):
    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="good")
    before, tokens = state(engine), greedy(engine)
    good = checkpoint(qwen3_dir)
    wrong_shape = {**good, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    unknown = {**good, "model.layers.0.mlp.not_a_weight": torch.zeros(2)}
    for tensors, offender in [
        (wrong_shape, "model.layers.0.self_attn.q_proj.weight"),
        (unknown, "model.layers.0.mlp.not_a_weight"),
    ]:
        with pytest.raises(EngineError) as err:
            push_tensors(engine, 2, list(iter_buckets(tensors.items(), BUCKET_BYTES)), weight_version="bad")
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
        assert state(engine) == before
    record = {"name": "model.norm.weight", "dtype": torch.float32, "start_idx": 0, "end_idx": 64, "numel": 64}
    negative = {"flattened_tensor": torch.ones(64), "metadata": [{**record, "shape": (-8, -8)}]}  # 64 elements
    with pytest.raises(EngineError) as err:  # every rank failed it outside the refusal path: the engine died
        call(
            engine,
            "update_weights_from_tensor",
            [serialize(negative) for _ in range(2)],
            load_format="flattened_bucket",
        )
    assert err.value.status_code == 400 and "shape (-8, -8) has a negative size" in err.value.message
    assert state(engine) == before
    with pytest.raises(EngineError) as err:  # one payload for two ranks
        call(engine, "update_weights_from_tensor", [serialize(list(good.items()))], weight_version="bad")
    assert err.value.status_code == 400 and "tp_size=2" in err.value.message
    with pytest.raises(EngineError) as err:  # rank 1 reads entry 1; rank 0's good entry is not applied alone
        call(
            engine,
            "update_weights_from_tensor",
            [serialize(list(checkpoint(qwen3_dir_b).items())), "%%%"],
            weight_version="bad",
        )
    assert "serialized_named_tensors[1]" in err.value.message and "[0]" not in err.value.message
    assert state(engine) == before

    class RunsAShellCommand:
        def __reduce__(self):
            return (os.system, ("touch /tmp/rollfleet-engine-pwned",))

    evil = base64.b64encode(pickle.dumps([("x", RunsAShellCommand())])).decode()
    with pytest.raises(EngineError) as err:
        call(engine, "update_weights_from_tensor", [evil, evil], weight_version="bad")
    assert err.value.status_code == 400 and "system" in err.value.message and "refused global" in err.value.message
    assert not os.path.exists("/tmp/rollfleet-engine-pwned")
    assert state(engine) == before and greedy(engine) == tokens


def test_moe_tp2_ep2_sync_over_the_tensor_route(servers, moe_dir, moe_dir_b):
    """Per-expert checkpoint names; all experts of a layer must arrive in one call (here: all)."""
    engine = servers["moe"]
    call(engine, "update_weights_from_disk", moe_dir)
    tensors = checkpoint(moe_dir_b)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert name in tensors
    push_tensors(engine, 2, list(iter_buckets(tensors.items(), BUCKET_BYTES)), weight_version="moe-b")
    assert greedy(engine) == expected(moe_dir_b)
    got = call(engine, "get_weights_by_name", name, truncate_size=7)
    assert torch.allclose(torch.tensor(got), tensors[name][:7])
    pushed = call(engine, "shard_fingerprints")
    call(engine, "update_weights_from_disk", moe_dir)
    call(engine, "update_weights_from_disk", moe_dir_b)  # equals a fresh load (test_engine_tp)
    assert call(engine, "shard_fingerprints") == pushed


# ---- distributed route -----------------------------------------------------------------------------
def sglang_style_rank0(port: int, world_size: int, group_name: str) -> dist.ProcessGroup:
    """Group rank 0 as trainers written for SGLang make it (init_custom_process_group)."""
    timeout = timedelta(seconds=60)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, 0, [], Backend("gloo"), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


class Sender:
    """This process as group rank 0 of one engine's weight-update group."""

    def __init__(self, engine, tp: int, group_name: str):
        self.engine, self.group_name, self.pool = engine, group_name, ThreadPoolExecutor(1)
        port, world_size = free_port(), 1 + tp
        joining = self.pool.submit(
            call,
            engine,
            "init_weights_update_group",
            "127.0.0.1",
            port,
            1,
            world_size,
            group_name=group_name,
            backend="nccl",
        )  # CPU engine: joins with gloo
        self.group = sglang_style_rank0(port, world_size, group_name)
        assert joining.result(timeout=60)["success"] is True

    def update(self, named: list[tuple[str, torch.Tensor]], load_format=None, broadcast=None, **kwargs):
        """Announce `named` over HTTP while broadcasting them; returns the HTTP result (or raises)."""
        request = self.pool.submit(
            call,
            self.engine,
            "update_weights_from_distributed",
            [n for n, _ in named],
            [dtype_name(t.dtype) for _, t in named],
            [list(t.shape) for _, t in named],
            group_name=self.group_name,
            load_format=load_format,
            **kwargs,
        )
        for tensor in broadcast if broadcast is not None else self.wire_tensors(named, load_format):
            dist.broadcast(tensor, src=0, group=self.group)
        return request.result(timeout=60)

    @staticmethod
    def wire_tensors(named, load_format):
        if load_format == "flattened_bucket":  # one uint8 broadcast of all the bytes, in order
            return [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])]
        return [t.contiguous() for _, t in named]

    def close(self):
        call(self.engine, "destroy_weights_update_group", group_name=self.group_name)
        dist.destroy_process_group(self.group)
        self.pool.shutdown()


@pytest.mark.parametrize("key", ["tp1", "tp2"])
def test_distributed_route_buckets_and_per_tensor_broadcasts(servers, key, qwen3_dir, qwen3_dir_b):
    engine, tp = servers[key], tp_of(key)
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    sender = Sender(engine, tp, group_name=f"sync-{key}")
    buckets = list(iter_buckets(checkpoint(qwen3_dir_b).items(), BUCKET_BYTES))
    for bucket in buckets[:-1]:  # one call and one broadcast per bucket
        out = sender.update(
            list(bucket.unpack().items()),
            load_format="flattened_bucket",
            broadcast=[bucket.flattened_tensor.view(torch.uint8)],
        )
        assert out["success"] is True
    # the last bucket's tensors one broadcast each (load_format null), and the version with them
    sender.update(list(buckets[-1].unpack().items()), weight_version="dist-b")
    assert greedy(engine) == expected(qwen3_dir_b)
    prints, version = state(engine)
    assert version == "dist-b" and prints == call(servers[f"ref{tp}"], "shard_fingerprints")
    sender.close()


def test_distributed_bucket_of_mixed_dtypes(servers, qwen3_dir, qwen3_dir_b):
    """One flattened broadcast holding float32 and bfloat16 tensors back to back; the engine (float32)
    casts on load."""
    engine = servers["tp1"]
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    sender = Sender(engine, 1, group_name="mixed")
    new = checkpoint(qwen3_dir_b)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    named = [(q, new[q]), (k, new[k].to(torch.bfloat16))]
    assert sender.update(named, load_format="flattened_bucket")["success"] is True
    for name, tensor in named:
        got = call(engine, "get_weights_by_name", name, truncate_size=7)
        assert torch.equal(torch.tensor(got), tensor.float()[:7])
    sender.close()


def test_numbered_calls_run_in_number_order_whatever_order_they_arrive_in(servers, qwen3_dir, qwen3_dir_b):
    """rollfleet's extension: every call is announced before any broadcast, the last first; the
    engine runs them by number, so each receives its own broadcast."""
    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="a")
    assert call(engine, "get_server_info")["rollfleet_ordered_weight_calls"] is True
    sender = Sender(engine, 2, group_name="ordered")
    buckets = list(iter_buckets(checkpoint(qwen3_dir_b).items(), BUCKET_BYTES))
    assert len(buckets) >= 3
    with ThreadPoolExecutor(len(buckets)) as pool:
        answers = []
        for count, index in enumerate(reversed(range(len(buckets))), start=1):
            named = list(buckets[index].unpack().items())
            answers.append(
                pool.submit(
                    call,
                    engine,
                    "update_weights_from_distributed",
                    [n for n, _ in named],
                    [dtype_name(t.dtype) for _, t in named],
                    [list(t.shape) for _, t in named],
                    group_name="ordered",
                    load_format="flattened_bucket",
                    order=("s1", index),
                )
            )
            if index > 0:  # it waits for its turn before the next (lower) number is sent
                calls_waiting_reach(engine, count)
        for bucket in buckets:
            dist.broadcast(bucket.flattened_tensor.view(torch.uint8), src=0, group=sender.group)
        assert all(answer.result(timeout=60)["success"] for answer in answers)
    call(engine, "update_weight_version", "ordered-b")
    assert greedy(engine) == expected(qwen3_dir_b)
    assert call(engine, "shard_fingerprints") == call(servers["ref2"], "shard_fingerprints")
    sender.close()


def calls_waiting_reach(engine, count: int, timeout: float = 30) -> None:
    """Until `count` numbered calls wait for their turn on the engine (its own state, not time)."""
    deadline = time.monotonic() + timeout
    while call(engine, "get_server_info")["rollfleet_weight_calls_waiting"] != count:
        assert time.monotonic() < deadline, f"{count} numbered calls not waiting within {timeout} s"
        time.sleep(0.005)


def test_refused_distributed_updates_drain_the_broadcast_and_change_nothing(servers, qwen3_dir, qwen3_dir_b):
    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir, weight_version="good")
    before = state(engine)
    sender = Sender(engine, 2, group_name="refusals")
    q = "model.layers.0.self_attn.q_proj.weight"
    new = checkpoint(qwen3_dir_b)
    cases = [
        ([(q, torch.zeros(3, 3))], None, q),  # the sender broadcasts what it announced: drained
        (
            [(q, new[q]), ("model.layers.0.mlp.not_a_weight", torch.ones(5))],
            "flattened_bucket",
            "model.layers.0.mlp.not_a_weight",
        ),
        ([(q, new[q].to(torch.int64))], None, "non-floating"),
    ]
    for named, load_format, offender in cases:
        with pytest.raises(EngineError) as err:
            sender.update(named, load_format=load_format, weight_version="bad")
        assert err.value.status_code == 400 and offender in err.value.message, err.value.message
        assert "received and dropped" in err.value.message
        assert state(engine) == before
    # the group is still in step: a good update goes through right after
    sender.update([(q, new[q])], load_format="flattened_bucket", weight_version="q-only")
    assert call(engine, "get_model_info")["weight_version"] == "q-only"
    sender.close()
    with pytest.raises(EngineError) as err:
        call(engine, "update_weights_from_distributed", [q], ["float32"], [[64, 64]], group_name="refusals")
    assert err.value.status_code == 400 and "init_weights_update_group" in err.value.message


def test_join_timeout_names_the_group_and_ranks(servers, qwen3_dir):
    engine = servers["tp2"]
    call(engine, "update_weights_from_disk", qwen3_dir)  # weights to serve with (a dummy start has none)
    port = free_port()  # nobody serves it: group rank 0 never comes
    with pytest.raises(EngineError) as err:
        call(
            engine,
            "init_weights_update_group",
            "127.0.0.1",
            port,
            1,
            3,
            group_name="lonely",
            backend="gloo",
            timeout_s=1,
        )
    message = err.value.message
    assert err.value.status_code == 400
    for part in ["'lonely'", f"127.0.0.1:{port}", "world_size=3", "[1, 2]", "within 1 s"]:
        assert part in message, message
    assert greedy(engine)  # still serving
    sender = Sender(engine, 2, group_name="lonely")  # nothing half-joined is left behind
    sender.close()
