"""One decode step of the embedded engine's paged path, against the HBM roofline of that step.

    rollfleet bench decode-step [--batches 1,64,256,512 --context 320]

The benchmark model (shapes.py: Qwen3-shaped 2.08B, vocabulary 151,936, bf16) on the paged KV pool
(rollfleet/engine/kv/), each batch's rows holding `--context` tokens of KV: the step eagerly and
replayed from its CUDA graph, the logits of the two compared, and the roofline: the bytes the step
must read (the weights without the embedding table, plus the live KV) over a device copy's
bandwidth measured in the same run. Prints one line per batch size as it goes.

`--profile DIR`: the largest batch's replayed steps again under torch.profiler: DIR/decode-profile.txt
(the GPU's busy share of the wall time, the host's time per step, the kernels by GPU time) and a
Chrome trace, DIR/decode-trace.json.

`--shared-prompt 1024 [--samples 8]`: each 8 rows share their first 1,024 tokens' pages, as a GRPO
step's samples share their prompt; with `--shared-prefix-keys 0` the decode kernel reads them once a
row, by default once a group (its prefix pass, kv/prefix_groups.py): run both for the difference.

`--host-only` (any machine): the host's work of a decode step alone, the scheduler's
(kv/steps.py: feeds, rows, sampling rows, token records, stop checks) over GRPO-shaped rows (8
samples a prompt of 64 tokens, temperature 1, output logprobs), the forward replaced by fixed logits
of a 32-token vocabulary: what a GPU step pays on its host besides the replay.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch

from rollfleet.bench.shapes import add_vocab_flag, write_model
from rollfleet.engine.kv.prefix_groups import MIN_SHARED_KEYS


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


def profile_steps(step, repeats: int, device, out: Path, label: str) -> dict:
    """`repeats` calls of `step` under torch.profiler: GPU busy share, host ms per step, kernel table."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        issued = time.perf_counter()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    figures = {
        "label": label,
        "wall_ms_per_step": wall / repeats * 1e3,
        "gpu_ms_per_step": kernels_s / repeats * 1e3,
        "gpu_busy_share": kernels_s / wall,
        "host_issue_ms_per_step": (issued - start) / repeats * 1e3,
    }
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "decode-profile.txt", "a") as f:
        f.write(json.dumps(figures) + "\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70) + "\n")
    prof.export_chrome_trace(str(out / "decode-trace.json"))
    return figures


def _line(batch: int, eager: float, graph: float, roof: float, eager_logits, graph_logits) -> dict:
    return {
        "batch": batch,
        "eager_ms": eager * 1e3,
        "graph_ms": graph * 1e3,
        "roofline_ms": roof * 1e3,
        "graph_over_roofline": graph / roof,
        "tok_s_graph": batch / graph,
        "argmax_equal": (eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean().item(),
        "max_abs_logit_diff": (eager_logits - graph_logits).abs().max().item(),
    }


def host_step_ms(batch: int, steps: int = 48) -> tuple[float, float]:
    """(median, min) ms of the host's work of one decode step of `batch` rows (`--host-only`): the
    overlapped step as a GPU engine runs it (kv/overlap.py: launch t+1, record t) and the graph's
    inputs on the host (kv/tables.py `step_inputs`), the forward replaced by fixed logits."""
    from rollfleet.engine.kv.blocks import BlockPool
    from rollfleet.engine.kv.steps import PagedBatches
    from rollfleet.engine.kv.tables import TableMirror, step_inputs
    from rollfleet.engine.sequences.logprobs import LogprobAsk
    from rollfleet.engine.sequences.next_token import StopRules
    from rollfleet.engine.sequences.sampling import Sampler
    from rollfleet.engine.sequences.sequence import sample_group
    from rollfleet.wire.protocol import SamplingParams

    logits = torch.randn(batch, 32)
    mirror = TableMirror(batch, -(-(64 + steps + 2) // 16) + 1, pin=False)

    def step(action, rows, logits_at, ids=None, **_):
        if all(len(tokens) == 1 for _, tokens, _ in rows):  # a decode step: its graph's inputs
            step_inputs(rows, 16, mirror, fed=ids is None)
        return logits[: len(logits_at)]

    blocks = BlockPool(num_pages=batch * (64 + steps) // 16 + 2 * batch, page_size=16, prefix_cache=True)
    batches = PagedBatches(
        blocks, lockstep=step, sampler=Sampler(), stops=StopRules(frozenset(), 4096, None), read_routes=lambda: None,
        kv_epoch=lambda: 0, weights_generation=lambda: 0, adapter_identity=lambda name: "base", chunk_tokens=None,
    )  # fmt: skip
    batches.overlap = True
    params = SamplingParams(temperature=1.0, max_new_tokens=steps + 4, ignore_eos=True, n=8)
    running = []
    for prompt in range(-(-batch // 8)):
        running += sample_group(
            [1 + (prompt * 7 + i) % 900 for i in range(64)], params, f"r{prompt}", True, None, LogprobAsk()
        )
    running = running[:batch]
    batches.advance(running, recompute=False, lora_name=None, overlap=True)  # the prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batches.advance(running, recompute=False, lora_name=None, overlap=True)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3, times[0] * 1e3


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
        "--shared-prompt",
        type=int,
        default=0,
        help="tokens of KV that each group of --samples rows shares (a request's samples over its prompt; its "
        "full pages), as GRPO's steps have them; 0: every row's pages its own",
    )
    p.add_argument("--samples", type=int, default=8, help="rows a prompt's pages are shared by (--shared-prompt)")
    p.add_argument(
        "--shared-prefix-keys",
        type=int,
        default=MIN_SHARED_KEYS,
        help="the engine's --rollfleet-shared-prefix-keys: groups sharing this many keys take the decode "
        "kernel's prefix pass (0: never; run both for the difference)",
    )
    p.add_argument("--profile", default=None, help="folder: the largest batch's steps under torch.profiler")
    p.add_argument("--host-only", action="store_true", help="the scheduler's host work of a step alone (any machine)")
    p.add_argument(
        "--attention-backend",
        choices=["triton", "torch_native"],
        default="triton",
        help="triton: decode reads the pages in place (kv/decode_kernel.py); torch_native: gather + SDPA",
    )
    p.add_argument(
        "--attention-inputs",
        choices=["fused", "transformers"],
        default="fused",
        help="with triton: fused, q/k/v and gate/up each one product (kv/fused_projections.py), q/k norms, "
        "rotary and K/V writes one kernel (kv/qkv_kernel.py); transformers: its own projections, norms and "
        "rotary, then the pool writes (run both for the difference)",
    )
    add_vocab_flag(p)
    return p.parse_args(argv)


def decode_rows(batch: int, context: int, page_size: int, shared: int, samples: int) -> tuple[list, int]:
    """A decode step's rows ((KV length, [token], pages) each) over `context` tokens of KV, and the pages
    they take (page 0 the trash page): each row's pages its own, or each `samples` rows in turn over
    the same first `shared` // page_size pages (never the page the step writes)."""
    pages_per_row = -(-(context + 1) // page_size)
    common = min(shared // page_size, context // page_size)
    rows, fresh, lead = [], 1, []
    for row in range(batch):
        if row % samples == 0:
            lead, fresh = list(range(fresh, fresh + common)), fresh + common
        own = pages_per_row - common
        rows.append((context, [7 + row % 100], lead + list(range(fresh, fresh + own))))
        fresh += own
    return rows, fresh


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.host_only:
        torch.set_num_threads(1)  # as an engine's host thread works
        for batch in [int(b) for b in args.batches.split(",")]:
            median, least = host_step_ms(batch)
            print(json.dumps({"batch": batch, "host_ms_median": round(median, 3), "host_ms_min": round(least, 3)}))
        return
    from transformers import AutoModelForCausalLM

    from rollfleet.engine.kv.paged import PagedModel, fuse_fast_path

    device = torch.device("cuda")
    scratch = Path(tempfile.mkdtemp(prefix="rf-decode-"))
    model_dir = write_model(scratch / "model", args.hidden, args.layers, torch.bfloat16, args.vocab)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": device}).eval()
    if args.attention_inputs == "fused" and args.attention_backend == "triton":  # as the engine does (model.py)
        fuse_fast_path(model, {"kernel": True}, device, tp_size=1, ep_size=1)

    class _NoAdapter:
        def use(self, name):
            pass

    batches = [int(b) for b in args.batches.split(",")]
    size, kernel = args.page_size, args.attention_backend == "triton"
    options = {"kernel": kernel, "fuse_inputs": args.attention_inputs == "fused"}
    options["shared_prefix_keys"] = args.shared_prefix_keys
    paged = PagedModel(model, _NoAdapter(), None, tp_size=1, device=device, page_size=size, graphs=True, **options)
    rows_of = functools.partial(decode_rows, context=args.context, page_size=size, shared=args.shared_prompt)
    paged.allocate(num_pages=rows_of(max(batches), samples=args.samples)[1], max_graph_batch=max(batches))
    weights = sum(t.nbytes for n, t in model.named_parameters() if "embed_tokens" not in n)
    bandwidth = copy_bandwidth(device)
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s; weights read per step {weights / 1e9:.2f} GB; "
        f"decode attention {'triton (pages in place)' if paged.kernel else 'gather + SDPA'}; "
        f"attention inputs {args.attention_inputs if paged.kernel else 'transformers'}",
        flush=True,
    )
    results = []
    for batch in batches:
        rows = rows_of(batch, samples=args.samples)[0]
        logits_at = list(range(batch))
        graphs = paged.graphs
        graphs.disabled = "off for the eager timing"
        eager_logits = paged.step(rows, logits_at).float()
        eager = _timed(lambda rows=rows, at=logits_at: paged.step(rows, at), args.repeats, device)
        graphs.disabled = None
        graph_logits = paged.step(rows, logits_at).float()  # captures
        graph = _timed(lambda rows=rows, at=logits_at: paged.step(rows, at), args.repeats, device)
        roof = (weights + batch * (args.context + 1) * paged.shape.bytes_per_token) / (bandwidth * 1e9)
        line = _line(batch, eager, graph, roof, eager_logits, graph_logits)
        results.append(line)
        print(json.dumps(line), flush=True)
        if args.profile and batch == max(batches):
            step = lambda rows=rows, at=logits_at: paged.step(rows, at)  # noqa: E731
            print(json.dumps(profile_steps(step, args.repeats, device, Path(args.profile), f"graph {batch}")))
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gb_s": bandwidth, "steps": results}, indent=1))


if __name__ == "__main__":
    main()
