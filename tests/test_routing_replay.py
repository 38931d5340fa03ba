"""Routing replay in the FSDP2 trainer (one gloo rank on CPU) on the tiny Qwen3-MoE: replaying the
router's own choices changes nothing, forcing other experts gives exactly the forward of a plain
transformers model routed the same way, and the router still learns."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rollfleet.train.fsdp import PolicyTrainer, TrainConfig
from rollfleet.train.routing_replay import check_replayable
from rollfleet.train.sharding import init_distributed
from rollfleet.wire.net import free_port
from rollfleet.wire.routed_experts import encode_routed_experts

LAYERS, TOP_K, EXPERTS = 2, 2, 4
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def gloo():
    init_distributed(0, 1, master_port=free_port(), backend="gloo")
    yield
    dist.destroy_process_group()


def make_items(count: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    items = []
    for index in range(count):
        prompt = torch.randint(3, 300, (3 + index,), generator=g).tolist()
        output = torch.randint(3, 300, (4 + 2 * index,), generator=g).tolist()
        items.append({"prompt_ids": prompt, "output_ids": output, "advantage": float(index - 1)})
    return items


def plain_logprobs(model, ids: list[int], routes: torch.Tensor | None = None) -> list[float]:
    """Output-independent reference: logprob of each next token, the routers forced to `routes`
    ([positions, layers, top_k]) by replacing their forward (softmax over experts, gathered, renormalised
    if the router does so)."""
    model = copy.deepcopy(model)
    if routes is not None:
        for layer in range(LAYERS):
            gate = model.model.layers[layer].mlp.gate
            chosen = routes[:, layer]

            def forced(hidden, gate=gate, chosen=chosen):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                weights = torch.softmax(logits, -1).gather(-1, chosen)
                if gate.norm_topk_prob:
                    weights = weights / weights.sum(-1, keepdim=True)
                return logits, weights, chosen

            gate.forward = forced
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def own_routes(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([torch.topk(torch.softmax(r, -1), TOP_K).indices for r in out.router_logits], dim=1)


def other_routes(model, ids: list[int]) -> torch.Tensor:
    """The experts the router ranks LAST: every position routed differently from its own choice."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([torch.topk(-r, TOP_K).indices for r in out.router_logits], dim=1)


def batch_of(items, model, routes_fn, logprob_routes_fn=None) -> list[dict]:
    """Each item with `routed_experts` from routes_fn (every position but the last) and, as the
    engine's logprobs, the plain model's under logprob_routes_fn's routes (None: its own)."""
    batch = []
    for item in items:
        ids = item["prompt_ids"] + item["output_ids"]
        routes = routes_fn(model, ids[:-1])
        forced = (
            None
            if logprob_routes_fn is None
            else torch.cat([logprob_routes_fn(model, ids[:-1]), own_routes(model, ids)[-1:]])
        )
        logprobs = plain_logprobs(model, ids, forced)[len(item["prompt_ids"]) - 1 :]
        batch.append({**item, "logprobs": logprobs, "routed_experts": encode_routed_experts(routes)})
    return batch


def trainer(moe_dir, replay: bool, **overrides) -> PolicyTrainer:
    config = TrainConfig(lr=1e-2, micro_batch_size=2, routing_replay=replay, **overrides)
    return PolicyTrainer(moe_dir, config)


def test_replaying_the_routers_own_choices_changes_nothing(gloo, moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = batch_of(make_items(), model, own_routes)
    plain = trainer(moe_dir, replay=False).train_step(batch)
    replayed = trainer(moe_dir, replay=True).train_step(batch)
    assert replayed["logprob_mismatch_max"] < 1e-5 and plain["logprob_mismatch_max"] < 1e-5
    assert replayed["loss"] == pytest.approx(plain["loss"], abs=1e-6)


def test_forced_routes_give_the_plain_forward_routed_that_way(gloo, moe_dir):
    """The engine's logprobs come from a forward routed to other experts: without replay the trainer
    disagrees with them, with replay it matches them (and the router still gets a gradient)."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = batch_of(make_items(), model, other_routes, logprob_routes_fn=other_routes)
    plain = trainer(moe_dir, replay=False).train_step(batch)
    assert plain["logprob_mismatch_max"] > 1e-3  # routing matters in this model
    replaying = trainer(moe_dir, replay=True)
    before = dict(replaying.weight_source().named_tensors())[ROUTER].clone()
    replayed = replaying.train_step(batch)
    assert replayed["logprob_mismatch_max"] < 1e-5, replayed
    after = dict(replaying.weight_source().named_tensors())[ROUTER]
    assert not torch.equal(before, after)  # gate weights come from the router logits: it learns


def test_replay_with_a_reference_model_runs_it_on_the_same_routes(gloo, moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = batch_of(make_items(), model, other_routes, logprob_routes_fn=other_routes)
    metrics = trainer(moe_dir, replay=True, kl_coef=0.1).train_step(batch)
    assert metrics["kl"] < 1e-9  # policy == reference before the step, both routed alike


def test_bad_replay_batches_are_refused(gloo, moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = batch_of(make_items(1), model, own_routes)
    replaying = trainer(moe_dir, replay=True)
    with pytest.raises(ValueError, match=r"batch\[0\] has no routed_experts.*--enable-return-routed-experts"):
        replaying.train_step([{k: v for k, v in batch[0].items() if k != "routed_experts"}])
    ids = batch[0]["prompt_ids"] + batch[0]["output_ids"]
    short = {**batch[0], "routed_experts": encode_routed_experts(own_routes(model, ids[1:-1]))}
    with pytest.raises(ValueError, match=r"routed_experts for \d+ positions.*routed_experts_start_len=0"):
        replaying.train_step([short])


def test_dense_model_refused_at_start(gloo, qwen3_dir):
    with pytest.raises(ValueError, match="dense model.*train.routing_replay=false"):
        check_replayable(qwen3_dir)
    with pytest.raises(ValueError, match="no MoE router.*train.routing_replay=false"):
        trainer(qwen3_dir, replay=True)
