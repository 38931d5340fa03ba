"""A run's memory plan, made once in the driver before any engine or trainer starts: the inputs it
needs (the model's config.json, the GPU's size, the longest prompt), the plan itself
(rollfleet.fleet.memory_plan), logged and written as `memory-plan.json` in the run's output
directory, and the config with `auto` resolved, which is the only one the fleet and the trainers see.

Only a colocated run on GPUs is planned (the two share each GPU); elsewhere there is nothing to
share, and `auto` resolves to what runs did before the plan (memory_plan.unplanned)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import ray
import torch
from transformers import AutoConfig, AutoTokenizer

from rollfleet.config import ConfigError, RunConfig
from rollfleet.fleet.memory_figures import ModelShape
from rollfleet.fleet.memory_plan import plan_memory, unplanned
from rollfleet.fleet.placement import ensure_ray

log = logging.getLogger("rollfleet.memory")
PLAN_FILE = "memory-plan.json"
PROMPTS_MEASURED = 64  # the longest prompts (in characters) tokenized for the prompt bound


def plan_run(cfg: RunConfig, output_dir: Path, prompts: Sequence[str]) -> tuple[RunConfig, dict | None]:
    """The config the run starts with and its plan's figures (None when nothing is planned); raises
    ConfigError, before anything starts, when a colocated GPU run cannot fit."""
    if cfg.rollout.placement != "colocated" or not cfg.rollout.use_gpu:
        return unplanned(cfg), None
    shape = ModelShape.from_config(AutoConfig.from_pretrained(cfg.rollout.model_path).to_dict())
    plan = plan_memory(cfg, shape, gpu_total_bytes(cfg), prompt_bound(cfg.rollout.model_path, prompts))
    figures = {"parameters": shape.parameters(), **plan.as_dict()}
    log.warning("memory plan of each GPU: %s", json.dumps(figures))
    (output_dir / PLAN_FILE).write_text(json.dumps(figures, indent=2) + "\n")
    return plan.apply(cfg), figures


def prompt_bound(model_path: str, prompts: Sequence[str]) -> int:
    """Tokens of the longest prompt, over the longest ones by characters (as the fleet encodes them)."""
    if not prompts:
        return 0
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    longest = sorted(prompts, key=len, reverse=True)[:PROMPTS_MEASURED]
    return max(len(tokenizer.encode(p)) for p in longest)


def gpu_total_bytes(cfg: RunConfig) -> int:
    """The smallest GPU's memory: read in the driver when it sees GPUs (no CUDA context is made),
    else by one Ray task on a GPU of the cluster."""
    if torch.cuda.is_available():
        return _smallest_device()
    ensure_ray(cfg)
    if ray.cluster_resources().get("GPU", 0) < 1:
        raise ConfigError(
            "rollout.use_gpu=True: neither this driver nor the Ray cluster has a GPU "
            f"({ray.cluster_resources()}) (fix: set rollout.use_gpu=false, or join a Ray cluster with GPUs)"
        )
    return ray.get(ray.remote(num_gpus=1, max_calls=1)(_smallest_device).remote())


def _smallest_device() -> int:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the memory plan asked Ray for a GPU and got a process that sees no CUDA device "
            "(is the cluster's GPU count declared by hand? fix: start Ray's nodes where their GPUs are visible)"
        )
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
