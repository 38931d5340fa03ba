"""GPU probe: the trainer's gradients with the chunked log-probs against the plain full-logits path,
on one GPU (NCCL world of one, bf16 compute), a small Qwen3 with the real vocabulary; prints loss and
grad norm of each (a NaN names the path that makes it)."""

import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
from rollfleet.bench.shapes import write_model  # noqa: E402
from rollfleet.config import TrainConfig  # noqa: E402
from rollfleet.train.fsdp import PolicyTrainer  # noqa: E402
from rollfleet.train.sharding import init_distributed  # noqa: E402

init_distributed(0, 1, master_port=29517)
hidden, layers, length = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (256, 2, 20)
path = write_model(Path(tempfile.mkdtemp()) / "m", hidden, layers, torch.bfloat16)
gen = torch.Generator().manual_seed(0)
batch = []
for i in range(8):
    prompt = torch.randint(0, 150000, (5 + i,), generator=gen).tolist()
    out = torch.randint(0, 150000, (length + 3 * i,), generator=gen).tolist()
    batch.append(
        {"prompt_ids": prompt, "output_ids": out, "logprobs": [-11.0] * len(out), "advantage": (-1) ** i * 0.5}
    )


def plain(self, model, micro):
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = micro["input_ids"][:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


for name in ("chunked", "plain"):
    cfg = TrainConfig(lr=1e-6, micro_batch_size=1 if name.endswith("mb1") else 8)
    trainer = PolicyTrainer(path, cfg)
    if name == "plain":
        trainer._logprobs = plain.__get__(trainer)
    out = trainer.train_step(batch)
    bad = [
        n
        for n, p in trainer.model.named_parameters()
        if p.grad is not None and not torch.isfinite(p.grad.full_tensor()).all()
    ]
    print(
        name,
        "loss",
        out["loss"],
        "grad_norm",
        out["grad_norm"],
        "finite" if math.isfinite(out["grad_norm"]) else "NOT FINITE",
        flush=True,
    )
