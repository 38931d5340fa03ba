"""Prompt datasets: `{"prompt": ..., "answer": ...}` records, one JSON object per line.

Batches are a pure function of (seed, step): each epoch is a fresh permutation seeded by
(seed, epoch), and a batch that runs past the end of an epoch continues into the next one. A
resumed run therefore gets the same batches by passing the step it stopped at.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    answer: str
    index: int  # position in the dataset
    extra: dict[str, Any] = field(default_factory=dict)  # any other fields of the record


def _parse_record(record: Any, where: str, index: int) -> PromptItem:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(record).__name__}")
    for key in ("prompt", "answer"):
        if key not in record:
            raise ValueError(f"{where}: missing field '{key}' (each record needs 'prompt' and 'answer')")
    prompt, answer = record["prompt"], record["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: field 'answer' must be a string or a number, got {answer!r}")
    extra = {key: value for key, value in record.items() if key not in ("prompt", "answer")}
    return PromptItem(prompt=prompt, answer=str(answer), index=index, extra=extra)


class PromptDataset:
    """Prompts with answers, batched deterministically from a seed (see the module docstring)."""

    def __init__(self, items: Iterable[PromptItem]):
        self.items = list(items)
        if not self.items:
            raise ValueError("a PromptDataset needs at least one prompt")

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> PromptDataset:
        return cls(_parse_record(record, f"record {index}", index) for index, record in enumerate(records))

    @classmethod
    def from_jsonl(cls, path: str | Path) -> PromptDataset:
        """Read one record per line (blank lines are skipped); errors name the file and line."""
        path = Path(path)
        items = []
        with path.open() as file:
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
                items.append(_parse_record(record, where, len(items)))
        if not items:
            raise ValueError(f"{path} holds no records (expected one JSON object per line)")
        return cls(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def batch(self, step: int, batch_size: int, *, seed: int = 0) -> list[PromptItem]:
        """Batch number `step` (0-based) of the endless shuffled stream."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        size = len(self.items)
        out, permutations = [], {}
        for position in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(position, size)
            if epoch not in permutations:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
                permutations[epoch] = torch.randperm(size, generator=generator).tolist()
            out.append(self.items[permutations[epoch][offset]])
        return out
