"""Pydantic models for a whole run, read from YAML plus dotted overrides.

    cfg = load_config("run.yaml", ["rollout.tp_size=2", "rollout.sampling.top_p=0.9"])

Every model forbids unknown keys, so a typo is an error, not a silently ignored setting.
A bad value raises `ConfigError`; its message has one line per problem, of the form
`rollout.tp_size=0: must be >= 1 (fix: set rollout.tp_size to a value >= 1)`.
"""

from rollfleet.config.errors import ConfigError, FieldProblem
from rollfleet.config.loading import load_config, parse_config
from rollfleet.config.models import (
    GrpoConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    SamplingDefaults,
    TrainConfig,
    TrainerConfig,
)
from rollfleet.config.weight_sync import DiskSync, LoraSync, NcclSync, TensorSync, WeightSyncConfig

__all__ = [
    "ConfigError",
    "DiskSync",
    "FieldProblem",
    "GrpoConfig",
    "LoraSync",
    "NcclSync",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingDefaults",
    "TensorSync",
    "TrainConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "load_config",
    "parse_config",
]
