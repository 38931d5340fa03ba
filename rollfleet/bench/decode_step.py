"""One decode step of the embedded engine's paged path, against the HBM roofline of that step.

    rollfleet bench decode-step [--batches 1,64,256,512 --context 320]

The benchmark model (shapes.py: Qwen3-shaped 2.08B, vocabulary 151,936, bf16) on the paged KV pool
(rollfleet/engine/kv/), each batch's rows holding `--context` tokens of KV: the step eagerly and
replayed from its CUDA graph, the logits of the two compared, and the roofline: the bytes the step
must read (the weights without the embedding table, plus the live KV) over a device copy's
bandwidth measured in the same run. Prints one line per batch size as it goes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rollfleet.bench.shapes import add_vocab_flag, write_model


def copy_bandwidth(device: torch.device, gigabytes: float = 2.0) -> float:
    """GB/s of a device-to-device copy (read + write counted), best of 5."""
    source = torch.empty(int(gigabytes * 1e9) // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


def _timed(fn, repeats: int, device) -> float:
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollfleet bench decode-step")
    p.add_argument("--batches", default="1,64,256,512")
    p.add_argument("--context", type=int, default=320, help="KV tokens of every row")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--attention-backend",
        choices=["triton", "torch_native"],
        default="triton",
        help="triton: decode reads the pages in place (kv/decode_kernel.py); torch_native: gather + SDPA",
    )
    add_vocab_flag(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    from transformers import AutoModelForCausalLM

    from rollfleet.engine.kv.paged import PagedModel

    device = torch.device("cuda")
    scratch = Path(tempfile.mkdtemp(prefix="rf-decode-"))
    model_dir = write_model(scratch / "model", args.hidden, args.layers, torch.bfloat16, args.vocab)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": device}).eval()

    class _NoAdapter:
        def use(self, name):
            pass

    batches = [int(b) for b in args.batches.split(",")]
    size, pages_per_row = args.page_size, -(-(args.context + 1) // args.page_size)
    kernel = args.attention_backend == "triton"
    paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=device, page_size=size, graphs=True, kernel=kernel)
    paged.allocate(num_pages=max(batches) * pages_per_row + 1, max_graph_batch=max(batches))
    weights = sum(t.nbytes for n, t in model.named_parameters() if "embed_tokens" not in n)
    bandwidth = copy_bandwidth(device)
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s; weights read per step {weights / 1e9:.2f} GB; "
        f"decode attention {'triton (pages in place)' if paged.kernel else 'gather + SDPA'}",
        flush=True,
    )
    results = []
    for batch in batches:
        rows = [
            (args.context, [7 + row % 100], list(range(1 + row * pages_per_row, 1 + (row + 1) * pages_per_row)))
            for row in range(batch)
        ]
        logits_at = list(range(batch))
        graphs = paged.graphs
        graphs.disabled = "off for the eager timing"
        eager_logits = paged.step(rows, logits_at).float()
        eager = _timed(lambda rows=rows, at=logits_at: paged.step(rows, at), args.repeats, device)
        graphs.disabled = None
        graph_logits = paged.step(rows, logits_at).float()  # captures
        graph = _timed(lambda rows=rows, at=logits_at: paged.step(rows, at), args.repeats, device)
        kv = batch * (args.context + 1) * paged.shape.bytes_per_token
        roof = (weights + kv) / (bandwidth * 1e9)
        same = (eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean().item()
        diff = (eager_logits - graph_logits).abs().max().item()
        line = {
            "batch": batch,
            "eager_ms": eager * 1e3,
            "graph_ms": graph * 1e3,
            "roofline_ms": roof * 1e3,
            "graph_over_roofline": graph / roof,
            "tok_s_graph": batch / graph,
            "argmax_equal": same,
            "max_abs_logit_diff": diff,
        }
        results.append(line)
        print(json.dumps(line), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gb_s": bandwidth, "steps": results}, indent=1))


if __name__ == "__main__":
    main()
