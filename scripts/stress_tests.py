"""`make test-stress`: the chaos, recovery, standby and asynchronous-loop tests, several rounds in a
row, each with another seed for the faults' random choices (ROLLFLEET_CHAOS_SEED), while burners
keep every core busy beside them (a loaded CI machine is where an event-less wait fails). Not part
of `make test`; run it before a change to fleet/, train/ or the engine's runtime/ lands.

    python scripts/stress_tests.py [--rounds 5] [--burners N] [pytest args...]

Prints each round's outcome and time and exits non-zero when any round failed."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

MODULES = [
    "tests/test_grpo_loop.py::test_chaos_engines_killed_during_a_run",
    "tests/test_grpo_loop.py::test_chaos_async_engine_killed_mid_generation",
    "tests/test_recovery.py",
    "tests/test_standby.py",
    "tests/test_async_loop.py",
]


def burn(stop) -> None:
    """Keep one core busy until `stop` is set."""
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy processes beside the tests")
    args, pytest_args = parser.parse_known_args()
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=burn, args=(stop,), daemon=True) for _ in range(args.burners)]
    for process in burners:
        process.start()
    outcomes = []
    try:
        for round_ in range(args.rounds):
            env = {**os.environ, "ROLLFLEET_CHAOS_SEED": str(round_)}
            began = time.monotonic()
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES, *pytest_args]
            code = subprocess.call(command, env=env)
            outcomes.append((round_, code, time.monotonic() - began))
            print(
                f"stress round {round_ + 1}/{args.rounds} (seed {round_}): {'passed' if code == 0 else 'FAILED'} "
                f"in {time.monotonic() - began:.0f} s",
                flush=True,
            )
    finally:
        stop.set()
        for process in burners:
            process.join(timeout=5)
    passed = sum(code == 0 for _, code, _ in outcomes)
    total = sum(seconds for *_, seconds in outcomes)
    print(f"stress: {passed} of {len(outcomes)} rounds passed, {args.burners} burners, {total / 60:.1f} min in all")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
