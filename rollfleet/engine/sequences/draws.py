"""One step's draws on their way to the host (sampling.py makes them): the tokens stay on the device,
where the next step may read them (kv/overlap.py), while what the host records is copied over.

`wait()` says how long the host blocked for them: the overlapped decode step reads step t's draws
after launching step t+1, so a host that waits at every step never keeps the device idle between
steps (the scheduler's `device_wait_seconds` and `device_waits`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollfleet.engine.sequences.device_copy import to_device, to_host_soon


@dataclass
class Sampled:
    """One step's result on the host: per row the token, its logprob (None where not asked), and the
    asked top-k / chosen-id rows as [(logprob, token id)]."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[float, int]] | None]
    chosen: list[list[tuple[float, int]] | None]
    host_bytes: int


class Drawn:
    """One step's draws, still on the device. `tokens` ([rows] int64) may feed the next step before
    the host has read them (the overlapped decode step, kv/overlap.py). On a GPU the copies of what
    the host needs start at once, into pinned memory, and `collect()` waits for them alone, with
    the GIL released (`tolist` would hold it through the wait, and the HTTP thread, starved for a
    whole step, would let requests join one a step)."""

    def __init__(self, tokens: torch.Tensor, parts: dict[str, torch.Tensor], assemble: Callable[..., Sampled]):
        self.tokens, self._assemble = tokens, assemble
        self._host = {name: to_host_soon(tensor) for name, tensor in parts.items()}
        self._nbytes = sum(tensor.nbytes for tensor in parts.values())
        self._copied = None
        if tokens.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(tokens.device))

    def wait(self) -> float:
        """Block until the draws are on the host; the seconds it blocked (0: they were already, or a CPU)."""
        if self._copied is None or self._copied.query():
            return 0.0
        began = time.perf_counter()
        self._copied.synchronize()
        return time.perf_counter() - began

    def collect(self) -> Sampled:
        self.wait()
        return self._assemble({name: tensor.tolist() for name, tensor in self._host.items()}, self._nbytes)


class Joined:
    """A step's draws made in parts (`[(row indices, Drawn)]`), read as one `Drawn`."""

    def __init__(self, count: int, parts: list[tuple[list[int], Drawn]]):
        self._count, self._parts = count, parts
        self.tokens = torch.empty(count, dtype=torch.int64, device=parts[0][1].tokens.device)
        for index, drawn in parts:
            self.tokens[to_device(index, torch.long, self.tokens.device)] = drawn.tokens

    def wait(self) -> float:
        return sum(drawn.wait() for _, drawn in self._parts)

    def collect(self) -> Sampled:
        out = Sampled([0] * self._count, [None] * self._count, [None] * self._count, [None] * self._count, 0)
        for index, drawn in self._parts:
            part = drawn.collect()
            for j, i in enumerate(index):
                out.tokens[i], out.logprobs[i] = part.tokens[j], part.logprobs[j]
                out.top[i], out.chosen[i] = part.top[j], part.chosen[j]
            out.host_bytes += part.host_bytes
        return out
