"""Building one tp rank's model: its causal LM class, its device, transformers' TP/EP layout of it, and a
dummy build that allocates every weight without values and without reading a weight file."""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch.distributed.tensor import DTensor
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.distributed import DistributedConfig


def build_model(model_path: str, dtype: torch.dtype, dummy: bool, *, device: torch.device, tp_size: int, ep_size: int):
    """The model, laid out as transformers' TP/EP plan gives this rank (DTensor shards), on this
    rank's device in `dtype`: from the checkpoint's files, or (`dummy`) without values and
    without reading any weight file (`_parameters_left_unset`)."""
    config = AutoConfig.from_pretrained(model_path)
    distributed = _distributed_config(tp_size, ep_size)
    placement = {"device_map": {"": device}} if distributed is None else {"distributed_config": distributed}
    if not dummy:
        return model_class(config).from_pretrained(
            model_path, config=config, dtype=dtype, disable_mmap=True, **placement
        )
    # transformers' own loader lays out the model (meta device, then each missing key allocated
    # empty on its device: the shards, in `dtype`), given no tensors; it still computes the
    # buffers that are not weights (rotary inv_freq) as it does for any missing key. The engine
    # stays not ready, and weight reads are refused (ModelRunner._refuse_unloaded_reads), until weights arrive.
    with _parameters_left_unset(), _quiet_load_report():
        model = model_class(config).from_pretrained(None, config=config, state_dict={}, dtype=dtype, **placement)
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, f"dummy start left tensors on the meta device: {on_meta[:5]}"
    # The loader keeps the weight conversions it used, none here: keep every one the model has,
    # or checkpoint names that fuse (MoE experts) would be unknown to the weight schema.
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    return model


def _distributed_config(tp_size: int, ep_size: int) -> DistributedConfig | None:
    if tp_size == 1:
        return None
    if ep_size > 1:
        return DistributedConfig(tp_size=tp_size, ep_size=ep_size)
    return DistributedConfig(tp_size=tp_size, tp_plan="auto")


@contextlib.contextmanager
def _parameters_left_unset():
    """transformers initialises every key a load did not provide, skipping each tensor flagged
    `_is_hf_initialized` (transformers.initialization). Flag every parameter (plain or DTensor, the
    class attribute) for the length of a dummy build: parameters keep their allocation without
    values (no random fill, whose cost grows with the model), while buffers, which are plain
    tensors, are still computed. The flag is gone again on exit."""
    classes = (torch.nn.Parameter, DTensor)
    for cls in classes:
        cls._is_hf_initialized = True
    try:
        yield
    finally:
        for cls in classes:
            del cls._is_hf_initialized


@contextlib.contextmanager
def _quiet_load_report():
    """A dummy build lists every weight as MISSING in transformers' load report: expected, not worth
    a table in the engine's log."""
    report = logging.getLogger("transformers.modeling_utils")
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        yield
    finally:
        report.setLevel(level)


def model_class(config_or_path) -> type:
    """The causal LM class of a config (or of a model directory's config.json); the first call for
    an architecture imports its code, which takes seconds."""
    config = config_or_path
    if isinstance(config, str | os.PathLike):
        config = AutoConfig.from_pretrained(config)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def local_device(device_type: str, base_gpu_id: int, tp_rank: int) -> str:
    """The device of one tp rank: GPU base_gpu_id + tp_rank, or the CPU."""
    if device_type == "cpu":
        return "cpu"
    os.environ["LOCAL_RANK"] = str(base_gpu_id + tp_rank)  # transformers binds its TP device from this
    torch.cuda.set_device(base_gpu_id + tp_rank)
    return f"cuda:{base_gpu_id + tp_rank}"
