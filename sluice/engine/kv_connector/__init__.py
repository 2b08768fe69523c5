"""KV connectors: where KV blocks come from besides the RAM pool, and where they go.

`base.py` is the interface (a scheduler half and a worker half); `disk_tier.py` the disk
tier under the prefix cache (`disk_store.py` its files).
"""

from sluice.engine.kv_connector.base import (
    BlockIO,
    BlockTransfer,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from sluice.engine.kv_connector.disk_store import BlockFormat, DiskStore
from sluice.engine.kv_connector.disk_tier import disk_tier, model_fingerprint

__all__ = [
    "BlockFormat",
    "BlockIO",
    "BlockTransfer",
    "DiskStore",
    "KVConnector",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "disk_tier",
    "model_fingerprint",
]
