"""HF directories on disk: the one reader of a model directory's safetensors files, and the file
names of a peft adapter directory. Engines, transports, restores and benchmarks all read here."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class CheckpointReadError(ValueError):
    """A HF model directory cannot be read; the message names the path and the fix."""


def safetensors_files(path: str | Path) -> list[Path]:
    """The directory's `*.safetensors` files in name order, or CheckpointReadError saying what is wrong.

    Regular files only (a link to one counts): opening a FIFO blocks until someone writes to it, and
    the reader does not let go of the interpreter meanwhile, so one FIFO would freeze the server."""
    directory = Path(path)
    if problem := dir_problem(directory):
        raise CheckpointReadError(f"model_path={shown(path)} {problem}: give a HF model directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointReadError(
            f"model_path={str(path)!r} holds no *.safetensors file: save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    for file in files:
        try:
            mode = file.stat().st_mode
        except OSError as exc:  # a dangling link, or no permission
            raise CheckpointReadError(f"cannot read {file.name} in {str(path)!r}: {exc}") from exc
        if not stat.S_ISREG(mode):
            raise CheckpointReadError(
                f"{file.name} in {str(path)!r} is a {_file_kind(mode)}, not a regular file: a checkpoint "
                "directory holds the files save_pretrained wrote; remove or rename it"
            )
    return files


def dir_problem(path: str | Path) -> str | None:
    """Why a path from a request is not a directory to read ("is not a directory", or the error of a
    name too long or not permitted); None when it is one."""
    try:
        if Path(path).is_dir():
            return None
    except OSError as exc:  # ENAMETOOLONG, EACCES (is_dir answers False itself for ENOENT or a NUL byte)
        return f"cannot be read ({exc.strerror or exc})"
    return "is not a directory"


def shown(path: str | Path, limit: int = 200) -> str:
    """A path from a request as an error message quotes it: repr'd, cut to `limit` characters."""
    text = str(path)
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")]
    kinds += [(stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
    return next((kind for test, kind in kinds if test(mode)), "special file")


def iter_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every file, one file in memory at a time."""
    for file in safetensors_files(path):
        try:
            tensors = load_file(file, device=str(device))
        except (SafetensorError, OSError) as exc:
            raise CheckpointReadError(f"cannot read {file.name} in {str(path)!r}: {exc}") from exc
        yield from tensors.items()


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory."""
    return dict(iter_checkpoint(path))
