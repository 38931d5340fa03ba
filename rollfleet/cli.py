"""`rollfleet` command line: serve one engine, run benchmarks."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: rollfleet serve [engine flags]   (see rollfleet serve --help)\n"
             "       rollfleet bench batching [--requests N]")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from rollfleet.engine.server import main as serve
        serve(rest)
    elif command == "bench" and rest[:1] == ["batching"]:
        from rollfleet.bench.batching import main as bench_batching
        bench_batching(rest[1:])
    else:
        sys.exit(f"unknown command {' '.join(argv[:2])!r}\n{usage}")


if __name__ == "__main__":
    main()
