"""Launch flags of R-Fork (rollfleet.wire.remote_instance): SGLang's names and formats for the
destination, and rollfleet's bound on every wait (SGLang's own R-Fork waits without one)."""

from __future__ import annotations

import argparse
import json


def add_remote_instance_flags(p: argparse.ArgumentParser) -> None:
    """R-Fork (rollfleet.wire.remote_instance): SGLang's flags, and the bound on every wait."""
    p.add_argument("--remote-instance-weight-loader-seed-instance-ip", default=None, help="the seed's address")
    p.add_argument("--remote-instance-weight-loader-seed-instance-service-port", type=int, default=None)
    p.add_argument(
        "--remote-instance-weight-loader-send-weights-group-ports",
        type=json.loads,
        default=None,
        help="a JSON list, one port per tp rank, free on the seed's host: '[29600, 29601]'",
    )
    p.add_argument("--remote-instance-weight-loader-backend", default="nccl", choices=["nccl"], help="as SGLang")
    p.add_argument(
        "--rollfleet-remote-instance-timeout-s",
        type=float,
        default=300.0,
        help="rollfleet: bound on each R-Fork join and transfer, as seed and as destination (SGLang has none)",
    )


def check_remote_instance_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rollfleet_remote_instance_timeout_s <= 0:
        parser.error(f"--rollfleet-remote-instance-timeout-s {args.rollfleet_remote_instance_timeout_s}: must be > 0")
    if args.load_format != "remote_instance":
        return
    ip, port = (
        args.remote_instance_weight_loader_seed_instance_ip,
        args.remote_instance_weight_loader_seed_instance_service_port,
    )
    ports = args.remote_instance_weight_loader_send_weights_group_ports
    if ip is None or port is None or ports is None:
        parser.error(
            "--load-format remote_instance needs --remote-instance-weight-loader-seed-instance-ip, "
            "--remote-instance-weight-loader-seed-instance-service-port and "
            "--remote-instance-weight-loader-send-weights-group-ports (SGLang falls back to disk instead)"
        )
    if (
        not isinstance(ports, list)
        or len(ports) != args.tp_size
        or not all(isinstance(p, int) and 0 < p < 65536 for p in ports)
    ):
        parser.error(
            f"--remote-instance-weight-loader-send-weights-group-ports {ports!r}: give a JSON list of "
            f"{args.tp_size} TCP ports (one per tp rank), e.g. '[29600, 29601]'"
        )
