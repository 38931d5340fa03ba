"""The batch limit when --max-running-requests is not given (engine/kv/capacity.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollfleet.engine.kv.capacity import CPU_MAX_RUNNING_REQUESTS, kv_bytes_per_token, max_running_requests
from rollfleet.tiny_models import tiny_config


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer_on_one_rank():
    config = tiny_config(num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    assert kv_bytes_per_token(config, torch.bfloat16, 1) == 3 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(config, torch.float32, 2) == 3 * 2 * 1 * 16 * 4  # kv heads split over tp


def test_a_given_limit_wins_and_the_cpu_keeps_64():
    runner = SimpleNamespace(device=torch.device("cpu"), model=None, dtype=torch.float32)
    assert max_running_requests(SimpleNamespace(max_running_requests=7), runner, 512) == 7
    assert max_running_requests(SimpleNamespace(max_running_requests=None), runner, 512) == CPU_MAX_RUNNING_REQUESTS
