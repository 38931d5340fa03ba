"""GPU probe: one colocated GRPO step of examples/gpu-1x.yaml at 16 x 8 x 32 on MODEL (argv[1]); its
batch then trained again by a trainer in this process, with the chunked log-probs and with the plain
full-logits path: which of them gives a finite gradient norm on the loop's own samples."""

import math
import sys
import tempfile

import torch

sys.path.insert(0, ".")
from rollfleet.config import load_config  # noqa: E402
from rollfleet.train.fsdp import PolicyTrainer  # noqa: E402
from rollfleet.train.grpo import group_advantages  # noqa: E402
from rollfleet.train.loop import _train_item, train  # noqa: E402
from rollfleet.train.sharding import init_distributed  # noqa: E402

model, out = sys.argv[1], tempfile.mkdtemp()
cfg = load_config("examples/gpu-1x.yaml", [f"rollout.model_path={model}", "grpo.steps=1", "grpo.prompts_per_step=16",
                  "rollout.sampling.max_new_tokens=32", f"grpo.output_dir={out}", "ray.num_cpus=16"])  # fmt: skip
seen = {}
train(cfg, observe=lambda step, items, samples: seen.setdefault(step, samples))
samples = seen[0]
adv = group_advantages([s.reward for s in samples], 8)
batch = [_train_item(s, float(a)) for s, a in zip(samples, adv)]
flat = [x for s in samples for x in s.logprobs]
print("advantages", float(adv.abs().max()), "engine logprobs min", min(flat), "nan", sum(x != x for x in flat))
torch.save(batch, f"{out}/batch.pt")
import ray  # noqa: E402

ray.shutdown()
init_distributed(0, 1, master_port=29519)


def plain(self, model, micro):
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits[:, :-1].float()
    return logits.gather(-1, micro["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


for name in ("chunked", "plain"):
    trainer = PolicyTrainer(model, cfg.train.model_copy(update={"offload": False}))
    if name == "plain":
        trainer._logprobs = plain.__get__(trainer)
    result = trainer.train_step(batch)
    print(
        name, "loss", result["loss"], "grad_norm", result["grad_norm"], math.isfinite(result["grad_norm"]), flush=True
    )
    del trainer
    torch.cuda.empty_cache()
