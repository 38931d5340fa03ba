"""SGLang's R-Fork (load weights from a running engine), as both sides and the client spell it.

Who calls whom (SGLang's model_loader/remote_instance_weight_loader_utils.py and loader.py): the
*destination* (a new engine) calls the *seed* (a healthy engine of the same layout):
  1. `POST seed/init_weights_send_group_for_remote_instance` {master_address: the seed's address,
     ports: "p0,p1" (one per tp rank), group_rank: 0, world_size: 2, group_name, backend}; at the
     same time every destination tp rank i joins, as group rank 1, the group of two whose store the
     seed's tp rank i serves at master_address:ports[i].
  2. `POST seed/send_weights_to_remote_instance` {master_address, ports, group_name}; meanwhile each
     destination rank receives every parameter of its shard, broadcast by the seed (group rank 0)
     in `model.named_parameters()` order. The seed destroys its groups after the send.
Both sides name rank i's group `f"{group_name}_{ports[i]}_{i}"` (the store prefix must match).
"""

from __future__ import annotations

import json

INIT_ROUTE = "/init_weights_send_group_for_remote_instance"
SEND_ROUTE = "/send_weights_to_remote_instance"
LOAD_ROUTE = "/rollfleet/load_from_remote_instance"
LAYOUT_ROUTE = "/rollfleet/weight_layout"
LOAD_FORMAT = "remote_instance"


def parse_ports(ports: str) -> list[int]:
    """ "p0,p1" (SGLang's body format) -> [p0, p1]; ValueError naming the value and the fix."""
    parts = [part.strip() for part in ports.split(",")]
    if not all(part.isdigit() and 1 <= int(part) <= 65535 for part in parts):
        raise ValueError(
            f"ports={ports!r}: give one TCP port (1-65535) per tp rank, comma-separated, e.g. '29600,29601'"
        )
    return [int(part) for part in parts]


def format_ports(ports: list[int] | tuple[int, ...] | str) -> str:
    """The body format of `ports`: "p0,p1"."""
    return ports if isinstance(ports, str) else ",".join(str(int(p)) for p in ports)


def ports_flag(ports: list[int] | tuple[int, ...]) -> str:
    """The launch flag's format (SGLang parses `--remote-instance-weight-loader-send-weights-group-ports`
    as a JSON list): "[p0, p1]"."""
    return json.dumps([int(p) for p in ports])


def rank_group_name(group_name: str, port: int, tp_rank: int) -> str:
    """The group of tp rank `tp_rank` (SGLang's WeightExporter and RemoteInstanceConnector)."""
    return f"{group_name}_{port}_{tp_rank}"


def destination_group_name(host: str) -> str:
    """The group name a destination asks for at start (SGLang: `send_weights_<the destination's ip>`)."""
    return f"send_weights_{host}"
