"""Weight-update process groups: one group made of the sender (rank 0) and every engine rank.

The same function builds the group on both sides, so the store keys and ranks always agree:
engine i's ranks are `rank_offset + rank_in_engine` with `rank_offset = 1 + i * tp * pp`, and
`world_size = 1 + sum(tp * pp)` (rollfleet.layout has the formulas).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _get_default_group,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def join_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout: timedelta
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a process group unrelated to any default group.

    This is the recipe SGLang and the trainers written for it use (`init_custom_process_group`):
    a TCPStore at `tcp://master_address:master_port` served by rank 0, prefixed by `group_name`,
    and torch's own group constructor `_new_process_group_helper` (private API, checked on torch
    2.13 and 2.11). Building the group with the same call on both sides keeps the store keys
    identical, so a sender that uses SGLang's helper and an engine that uses this one meet. No
    default group is needed (a tp=1 engine has none). `timeout` bounds the join and every later
    collective.
    """
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    default_group = _get_default_group() if dist.is_initialized() else None
    bound_device = getattr(default_group, "bound_device_id", None)
    if default_group is not None:
        # A default group bound to a GPU makes torch split the new NCCL group from it, which would
        # build a communicator of this engine's ranks only, without the sender.
        default_group.bound_device_id = None
    try:
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
    finally:
        if default_group is not None:
            default_group.bound_device_id = bound_device
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def wait_for_store(master_address: str, master_port: int, timeout: timedelta) -> None:
    """Return once group rank 0's store accepts connections (or `timeout` passed: the join then fails
    with torch's own error). A client that tries before the store listens backs off for up to a
    second or more inside torch; polling here first makes a late host cost only its lateness."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        try:
            socket.create_connection((master_address, master_port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)
