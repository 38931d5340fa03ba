"""The roofline `rollfleet bench generate` measures engines against: the bytes a case's decode steps
must read (the weights but the input embedding table, and the KV cache live at each step) over a
device copy's bandwidth."""

from __future__ import annotations

import json
from pathlib import Path


def model_figures(model_dir: Path) -> dict:
    """What the roofline needs, from the written model: bytes a decode step reads of the weights, and
    KV bytes per token."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    total = embedding = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                count = 1
                for dim in tensor.get_shape():
                    count *= dim
                size = count * {"BF16": 2, "F16": 2, "F32": 4}[tensor.get_dtype()]
                total += size
                embedding += size if name.endswith("embed_tokens.weight") else 0
    dtype_bytes = 2 if config.get("dtype", config.get("torch_dtype")) in ("bfloat16", "float16") else 4
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes
    return {
        "weights_bytes": total,
        "embedding_bytes": embedding,
        "weights_read_per_step_bytes": total - embedding,
        "kv_bytes_per_token": kv_per_token,
    }


def roofline(case: tuple[int, int, int], prompt_tokens: int, figures: dict, copy_gb_per_s: float) -> dict:
    prompts, n, new_tokens = case
    rows = prompts * n
    live_tokens = rows * sum(prompt_tokens + t for t in range(new_tokens))  # over the steps
    nbytes = new_tokens * figures["weights_read_per_step_bytes"] + live_tokens * figures["kv_bytes_per_token"]
    seconds = nbytes / (copy_gb_per_s * 1e9)
    return {"steps": new_tokens, "bytes": nbytes, "seconds": seconds, "tok_s": rows * new_tokens / seconds}
