"""`rollfleet` command line: serve one engine, run benchmarks."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: rollfleet train CONFIG.yaml [key.path=value ...] [--resume]\n"
        "       rollfleet serve [engine flags]   (see rollfleet serve --help)\n"
        "       rollfleet bench batching [--requests N]\n"
        "       rollfleet bench agents [--episodes 64 --tool-latency-ms 20]\n"
        "       rollfleet bench weight-sync --transport {tensor,nccl,disk} --size-gb X\n"
        "       rollfleet bench recovery [--hidden 256 --layers 8]\n"
        "       rollfleet bench grpo-step [--runs colocated,disaggregated --steps 8]\n"
        "       rollfleet bench decode-step [--batches 1,64,256,512 --context 320]\n"
        "       rollfleet bench generate [--cases 64x8x256,16x8x32,1x1x256 --engines embedded,generate,generate_batch]"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return
    command, rest = argv[0], argv[1:]
    if command == "train":
        train_command(rest)
    elif command == "serve":
        from rollfleet.engine.process.server import main as serve

        serve(rest)
    elif command == "bench" and rest[:1] == ["batching"]:
        from rollfleet.bench.batching import main as bench_batching

        bench_batching(rest[1:])
    elif command == "bench" and rest[:1] == ["agents"]:
        from rollfleet.bench.agents import main as bench_agents

        bench_agents(rest[1:])
    elif command == "bench" and rest[:1] == ["recovery"]:
        from rollfleet.bench.recovery import main as bench_recovery

        bench_recovery(rest[1:])
    elif command == "bench" and rest[:1] == ["grpo-step"]:
        from rollfleet.bench.grpo_step import main as bench_grpo_step

        bench_grpo_step(rest[1:])
    elif command == "bench" and rest[:1] == ["generate"]:
        from rollfleet.bench.generate import main as bench_generate

        bench_generate(rest[1:])
    elif command == "bench" and rest[:1] == ["decode-step"]:
        from rollfleet.bench.decode_step import main as bench_decode_step

        bench_decode_step(rest[1:])
    elif command == "bench" and rest[:1] == ["weight-sync"]:
        from rollfleet.bench.weight_sync import main as bench_weight_sync

        bench_weight_sync(rest[1:])
    else:
        sys.exit(f"unknown command {' '.join(argv[:2])!r}\n{usage}")


def train_command(args: list[str]) -> None:
    from rollfleet.config import ConfigError, load_config

    resume = "--resume" in args
    args = [a for a in args if a != "--resume"]
    if not args or "=" in args[0]:
        sys.exit("usage: rollfleet train CONFIG.yaml [key.path=value ...] [--resume]")
    try:
        cfg = load_config(args[0], args[1:])
    except ConfigError as err:
        sys.exit(str(err))
    from rollfleet.train.loop import train

    try:
        output_dir = train(cfg, resume=resume)
    except ConfigError as err:  # what the config names outside itself (model, data, reward): one line, no traceback
        sys.exit(str(err))
    print(f"metrics, TensorBoard, checkpoints and curves.png are in {output_dir}")


if __name__ == "__main__":
    main()
