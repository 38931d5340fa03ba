"""The trainer's chunked log-probs (rollfleet.train.token_logprobs, `train.logprob_chunk`) against the
plain computation from the whole float32 logits (kept here as the reference): the same values and
gradients for any chunk size, with padding rows and loss masks as the loop collates them, a LoRA
adapter on the output head and tied embeddings; the largest logits the head makes, forward and
backward, are chunk x vocab, not rows x width x vocab; a model that changes its logits after the head
is refused."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_batch
from transformers import Gemma2Config, Gemma2ForCausalLM

from rollfleet.config import TrainConfig
from rollfleet.config.lora import LoraTrainConfig
from rollfleet.tiny_models import make_tiny_model
from rollfleet.train.fsdp import PolicyTrainer
from rollfleet.train.token_logprobs import ChunkedHead, chunked_token_logprobs

TEMPERATURE = 0.7


def full_logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference: the trainer's computation before chunking, from the whole logits."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("chunk", [1, 4, 7, 33, 1000])
def test_chunks_give_the_full_logits_values_and_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    # float64 head: gradients summed over chunks and in one product agree far below float32's rounding
    head = torch.nn.Linear(16, 50, dtype=torch.float64)
    hidden = torch.randn(3, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)  # 33 positions
    targets = torch.randint(0, 50, (3, 11), generator=g)
    weights = torch.randn(3, 11, generator=g)

    def run(score):
        head.zero_grad()
        hidden.grad = None
        values = score()
        (values * weights).sum().backward()
        return values.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()

    chunked = run(lambda: chunked_token_logprobs(head, hidden, targets, temperature=temperature, chunk=chunk))
    reference = run(lambda: full_logits_logprobs(head(hidden), targets, temperature))
    for got, want in zip(chunked, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-7)


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match=r"chunk=0.*train\.logprob_chunk >= 1"):
        chunked_token_logprobs(torch.nn.Linear(4, 5), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), chunk=0)


def micro_batch(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Ragged items, one with an episode's loss mask, and a zero-weight padding row, as the loop collates them."""
    items = make_batch(3, count=4)
    items[1] = {
        **items[1],
        "loss_mask": [1, 0] * (len(items[1]["output_ids"]) // 2) + [1] * (len(items[1]["output_ids"]) % 2),
    }
    return trainer._collate([*items, None])


class HeadOutputs:
    """The vocab-wide outputs the model's head makes (one per call), recorded by a forward hook."""

    def __init__(self, head: torch.nn.Module, vocab: int):
        self.shapes: list[torch.Size] = []
        head.register_forward_hook(
            lambda _m, _a, out: self.shapes.append(out.shape) if out.shape[-1] == vocab else None
        )

    def take(self) -> list[int]:
        sizes, self.shapes = [s.numel() for s in self.shapes], []
        return sizes


def values_and_grads(trainer: PolicyTrainer, micro: dict, score) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`score(model, micro)`'s log-probs and the gradients of their masked, advantage-weighted sum."""
    trainer.optimizer.zero_grad(set_to_none=True)
    values = score(trainer.model, micro)
    (values * micro["mask"] * micro["advantages"][:, None]).sum().backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return values.detach(), grads


def plain(trainer: PolicyTrainer):
    """The reference through the same (sharded) model: its whole logits, outside any scoring."""

    def score(model, micro):
        logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
        return full_logits_logprobs(logits[:, :-1], micro["input_ids"][:, 1:], trainer.temperature)

    return score


def check_against_the_full_logits(trainer: PolicyTrainer, chunks: list[int]) -> None:
    micro = micro_batch(trainer)
    rows, width = micro["input_ids"].shape
    vocab = trainer.model.config.vocab_size
    outputs = HeadOutputs(trainer.heads[id(trainer.model)].head, vocab)
    want_values, want_grads = values_and_grads(trainer, micro, plain(trainer))
    assert outputs.take() == [rows * width * vocab]  # what the plain way builds at once
    assert want_grads
    for chunk in chunks:
        trainer.heads[id(trainer.model)].chunk = chunk
        assert rows * (width - 1) > chunk  # more positions than one chunk: several chunks
        got_values, got_grads = values_and_grads(trainer, micro, trainer._logprobs)
        torch.testing.assert_close(got_values, want_values, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in got_grads.items():
            # float32 sums over positions in another order: rounding of ~1e-7 of the gradient's scale
            scale = want_grads[name].abs().max().item()
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6 * max(scale, 1.0))
        # forward, then backward's recompute: one head call per chunk each time, none wider than a chunk
        sizes, calls = outputs.take(), -(-rows * (width - 1) // chunk)
        assert len(sizes) == 2 * calls and max(sizes) == chunk * vocab < rows * width * vocab


@pytest.fixture
def tied_dir(tmp_path):
    return make_tiny_model(tmp_path / "tied", "qwen3", seed=1, tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [False, True])
def test_the_trainer_gives_the_full_logits_values_and_gradients_chunk_by_chunk(
    qwen3_dir, tied_dir, tied, gloo_world_of_one
):
    trainer = PolicyTrainer(tied_dir if tied else qwen3_dir, TrainConfig(), sampling_temperature=TEMPERATURE)
    assert trainer.model.config.tie_word_embeddings == tied
    check_against_the_full_logits(trainer, [1, 5, 7])


def test_a_lora_adapter_on_the_head_is_in_the_chunked_log_probs(qwen3_dir, gloo_world_of_one):
    lora = LoraTrainConfig(rank=4, alpha=8.0, target_modules=["q_proj", "lm_head"])
    trainer = PolicyTrainer(qwen3_dir, TrainConfig(lr=1e-2, lora=lora, kl_coef=0.1), sampling_temperature=TEMPERATURE)
    head = trainer.heads[id(trainer.model)].head
    assert hasattr(head, "lora_A")  # peft's layer: calling the module adds the adapter
    trainer.train_step(make_batch(0))  # the adapter's B leaves 0: the head's adapter changes the logits
    check_against_the_full_logits(trainer, [5, 7])
    micro = micro_batch(trainer)
    with torch.no_grad():
        with trainer._reference() as reference:  # the KL reference: the adapter disabled
            base = trainer._logprobs(reference, micro)
            torch.testing.assert_close(base, plain(trainer)(reference, micro))
        assert not torch.allclose(base, trainer._logprobs(trainer.model, micro), atol=1e-4)


def softcapped_gemma(cap: float | None) -> Gemma2ForCausalLM:
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=cap,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    ids = torch.tensor([[5, 9, 2, 33, 7]])
    model = softcapped_gemma(None)  # no softcap: the logits are the head's
    scorer = ChunkedHead(model, chunk=3)
    with torch.no_grad():
        with scorer.scoring(ids, 1.0):
            got = scorer.logprobs(model(input_ids=ids))
        torch.testing.assert_close(got, full_logits_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], 1.0))
    capped = softcapped_gemma(30.0)
    scorer = ChunkedHead(capped, chunk=3)
    with torch.no_grad(), scorer.scoring(ids, 1.0), pytest.raises(ValueError, match="transforms them after the head"):
        scorer.logprobs(capped(input_ids=ids))
