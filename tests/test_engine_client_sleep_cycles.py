"""Real clients' sleep/wake cycles, replayed call for call (method, route, JSON body, order) on one
embedded server: each client's cycle twice in a row, one client after the other, every call answered
2xx (XTuner's `raise_for_status` ends its run otherwise) and, after each cycle, the engine generates
the greedy tokens of the model on disk (the weights came back intact).

The server carries its state from one cycle to the next, as a real one does: XTuner resumes only
`weights` and `kv_cache` of the release of all tags, so `cuda_graph` stays released into its own
next release of all tags and into the next client's. SGLang 0.5.23 accepts that (its released tags
are a set; a release adds to it), and so must this engine.

Where each sequence comes from (read from the clients' code; the commit each was read at):
- XTuner, InternLM/xtuner b934f46: xtuner/v1/rl/rollout/sglang.py (`offload`: GET /flush_cache, then
  release `{}`; `onload_weights`; `onload_kvcache`), driven in that order by the colocated weight
  sync of xtuner/v1/train/rl_trainer.py (offload, onload_weights, weight_update, onload_kvcache).
- AReaL, inclusionAI/AReaL 4aef98d: areal/trainer/rl_trainer.py (`_offload_rollout`: pause_generation,
  release; `update_weights`; `_onload_rollout`: resume, continue_generation), the bodies in
  areal/engine/sglang_remote.py (`get_offload_request`, `get_onload_request` with no tags,
  `build_disk_weight_update_requests`), the pause and continue around the disk update in
  areal/engine/fsdp_engine.py `_update_weights_from_disk`.
- UniRL, Tencent-Hunyuan/UniRL 1a7b501: unirl/rollout/engine/sglang_llm/engine.py (`sleep`: GET
  /flush_cache, release `{}`; `wake_up`: resume `{}`, or `{"tags": ["kv_cache", "cuda_graph"]}` after
  `onload_weights` resumed `{"tags": ["weights"]}`); unirl/trainer/ar.py `train_step` (wake_up, weight
  sync, generate, sleep); the staged resume is the one unirl/rollout/engine/composed/engine.py makes
  before it pushes an adapter.

XTuner and UniRL push their weights over /update_weights_from_tensor (rollfleet's tensor transport
sends them the same way here); AReaL loads them from disk while they are released.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import call, reference_greedy
from transformers import AutoModelForCausalLM

from rollfleet.config import TensorSync
from rollfleet.weights.source import ModuleSource
from rollfleet.weights.transports.base import EngineTarget, make_transport

PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PUSH = "push the weights"  # the client sends its weights here
MODEL = "{model}"  # the model directory, filled in when the call is sent

XTUNER = [
    ("GET", "/flush_cache", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
    PUSH,
    ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
]
AREAL = [
    ("POST", "/pause_generation", {}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/pause_generation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": MODEL, "abort_all_requests": True}),
    ("POST", "/continue_generation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/continue_generation", {}),
]
UNIRL = [
    ("GET", "/flush_cache", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    PUSH,
]
UNIRL_STAGED = [
    ("GET", "/flush_cache", None),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
    PUSH,
    ("POST", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
]
# (client, its cycle, the tags it leaves released: SGLang 0.5.23's record after it), in the order run
CYCLES = [
    ("xtuner", XTUNER, ["cuda_graph"]),
    ("areal-after-xtuner", AREAL, []),
    ("xtuner-again", XTUNER, ["cuda_graph"]),
    ("unirl-after-xtuner", UNIRL, []),
    ("xtuner-once-more", XTUNER, ["cuda_graph"]),
    ("unirl-staged-after-xtuner", UNIRL_STAGED, []),
]


@pytest.fixture(scope="module")
def trainer_model(qwen3_dir):
    """What the trainer holds: the model on disk, which the pushes send back."""
    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected_tokens(qwen3_dir) -> list[int]:
    return reference_greedy(qwen3_dir, PROMPT, GREEDY["max_new_tokens"])[0]


def push(server, model, version: str) -> None:
    transport = make_transport(TensorSync(), [EngineTarget(0, server.url, 1, 1, dtype=torch.float32)], timeout_s=60)
    transport.connect()
    try:
        transport.send(ModuleSource(model), version)
    finally:
        transport.disconnect()


def replay(server, cycle: list, model_dir: str, model, version: str) -> None:
    for step in cycle:
        if step == PUSH:
            push(server, model, version)
            continue
        method, route, body = step
        if body and body.get("model_path") == MODEL:
            body = {**body, "model_path": model_dir}
        answer = httpx.request(method, server.url + route, json=body, timeout=60)
        assert answer.status_code == 200, (route, body, answer.status_code, answer.text)
        if route == "/release_memory_occupation":  # every tag held is freed, whatever was released before
            assert all(rank["weight_bytes"] == 0 for rank in call(server, "memory")), (route, body)


def greedy(server) -> list[int]:
    return call(server, "generate", input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize(("client", "cycle", "left_released"), CYCLES, ids=[name for name, _, _ in CYCLES])
def test_a_clients_cycle_twice_in_a_row_is_answered_and_serves_the_same_weights(
    qwen3_server, qwen3_dir, trainer_model, expected_tokens, client, cycle, left_released
):
    for round_number in (1, 2):
        replay(qwen3_server, cycle, qwen3_dir, trainer_model, f"{client}-{round_number}")
        assert call(qwen3_server, "get_server_info")["rollfleet_released_memory"] == left_released, round_number
        assert greedy(qwen3_server) == expected_tokens, (client, round_number)
        assert all(rank["weight_bytes"] > 0 for rank in call(qwen3_server, "memory"))
