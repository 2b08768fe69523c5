"""KV connectors: where KV blocks come from besides the RAM pool, and where they go.

`base.py` is the interface (a scheduler half and a worker half); `disk_tier.py` the disk
tier under the prefix cache (`disk_store.py` its files); `pd_prefill.py` and
`pd_decode.py` the two sides of a prefill/decode split (`pd_transport.py` moves their
blocks over TCP).
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
from sluice.engine.kv_connector.pd_decode import pd_decode_connector
from sluice.engine.kv_connector.pd_prefill import pd_prefill_connector

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
    "pd_decode_connector",
    "pd_prefill_connector",
]
