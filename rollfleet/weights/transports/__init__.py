"""Weight transports, registered by name: each moves a WeightSource's tensors to engines.

transport = make_transport(config.weight_sync, targets)
transport.connect(); report = transport.send(source, version); transport.disconnect()
"""

from rollfleet.weights.transports import disk, lora, nccl, tensor  # noqa: F401  (they register themselves)
from rollfleet.weights.transports.base import TRANSPORTS, EngineTarget, SyncReport, Transport, make_transport

__all__ = ["TRANSPORTS", "EngineTarget", "SyncReport", "Transport", "make_transport"]
