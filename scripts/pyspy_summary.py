"""A py-spy profile's raw (collapsed) stacks summed up small enough to bring back from a device call
(a raw file of 80 syncs is about 30 MB): per process and thread, each function's samples counted once
per stack (inclusive) and as the innermost frame (self), the top ones of each.

    py-spy record -r 1000 --nonblocking --threads --subprocesses -f raw -o RAW -- python3 -m rollfleet ...
    python3 scripts/pyspy_summary.py RAW [MARKER]    # MARKER: only stacks with a frame containing it
"""

from __future__ import annotations

import collections
import re
import sys

FRAME = re.compile(r"^(.*?) \((.*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    match = FRAME.match(frame)
    return f"{match.group(1)} ({match.group(2).rsplit('/', 1)[-1]})" if match else frame[:80]


def summarize(lines, marker: str | None = None) -> dict[str, tuple[int, collections.Counter, collections.Counter]]:
    groups: dict[str, list] = collections.defaultdict(lambda: [0, collections.Counter(), collections.Counter()])
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = [f for f in frames[:3] if f.startswith(("process ", "thread "))]
        if marker and not any(marker in f for f in frames):
            continue
        body = [_name(f) for f in frames[len(head) :]]
        group = groups[" / ".join(h[:60] for h in head) or "?"]
        group[0] += int(count)
        for name in set(body):
            group[1][name] += int(count)
        if body:
            group[2][body[-1]] += int(count)
    return {key: tuple(value) for key, value in groups.items()}


def main() -> None:
    with open(sys.argv[1], errors="replace") as raw:
        groups = summarize(raw, sys.argv[2] if len(sys.argv) > 2 else None)
    for key, (total, inclusive, innermost) in sorted(groups.items(), key=lambda item: -item[1][0]):
        if total < 50:
            continue
        print(f"\n=== {key}: {total} samples\n  inclusive:")
        for name, count in inclusive.most_common(45):
            print(f"    {count / total:6.1%} {count:7d}  {name}")
        print("  self:")
        for name, count in innermost.most_common(25):
            print(f"    {count / total:6.1%} {count:7d}  {name}")


if __name__ == "__main__":
    main()
