"""Write named full tensors as a HF model directory (safetensors shards + index + config files)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollfleet.wire.hf_files import iter_checkpoint

# Files of a HF model directory that are not weights; copied from the model's own directory.
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


PARTIAL = ".partial"  # the suffix of a directory being written


def partial_of(directory: str | Path) -> Path:
    """Where `atomic_directory` writes `directory` until it is whole."""
    final = Path(directory)
    return final.with_name(final.name + PARTIAL)


def begin_partial(directory: str | Path) -> Path:
    """`directory`'s temporary sibling, fresh (what a crashed write left is removed)."""
    partial = partial_of(directory)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


@contextmanager
def atomic_directory(directory: str | Path, *, begun: bool = False) -> Iterator[Path]:
    """A fresh temporary sibling (`partial_of`: `<name>.partial`) to write into; when the block ends
    without an error it replaces `directory`, so a reader never sees a half-written directory and a
    crash leaves none that looks complete. `begun`: the caller made it already (`begin_partial`), so
    that a reader sees the write under way from then on, before a thread that writes it starts."""
    final = Path(directory)
    partial = partial_of(directory) if begun else begin_partial(directory)
    yield partial
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)


def prune_versions(root: str | Path, keep: int = 2) -> None:
    """Delete all but the `keep` newest `version-*` directories under `root` (by modification time)."""
    versions = sorted(Path(root).glob("version-*"), key=lambda p: p.stat().st_mtime)
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    config_dir: str | Path | None = None,
    shard_bytes: int = 2 << 30,
) -> int:
    """Stream tensors into shards of at most `shard_bytes`; returns the bytes written.

    The directory is written under a temporary name and renamed at the end, so a reader never
    sees a half-written checkpoint (and a crash leaves no directory that looks complete)."""
    with atomic_directory(directory) as partial:
        return _write_checkpoint(named_tensors, partial, config_dir, shard_bytes)


def _write_checkpoint(named_tensors, partial: Path, config_dir, shard_bytes: int) -> int:
    shard: dict[str, torch.Tensor] = {}
    shard_size = total = 0
    files: list[dict[str, torch.Tensor]] = []

    def flush():
        nonlocal shard, shard_size
        if shard:
            files.append(shard)
            save_file(shard, partial / f"shard-{len(files):05d}.safetensors", metadata={"format": "pt"})
            shard, shard_size = {}, 0

    weight_map = {}
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_size + size > shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu").contiguous()
        weight_map[name] = f"shard-{len(files) + 1:05d}.safetensors"
        shard_size += size
        total += size
    flush()
    count = len(files)
    if count == 1:  # one file: model.safetensors and no index, as save_pretrained writes
        (partial / "shard-00001.safetensors").rename(partial / "model.safetensors")
    for index in range(count if count > 1 else 0):  # shard-00001-of-0000N naming, as save_pretrained writes
        (partial / f"shard-{index + 1:05d}.safetensors").rename(
            partial / f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        )
    if count > 1:
        weight_map = {k: f"model-{int(v[6:11]):05d}-of-{count:05d}.safetensors" for k, v in weight_map.items()}
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if config_dir is not None:
        for name in CONFIG_FILES:
            if (Path(config_dir) / name).exists():
                shutil.copy2(Path(config_dir) / name, partial / name)
    return total


class CheckpointSource:
    """A HF directory as a WeightSource: each file is read once per pass, whatever the number of
    engines the tensors then go to (the read-once fan-out of a restore)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def named_tensors(self):
        yield from iter_checkpoint(self.directory)
