"""kvstream.vllm: a vLLM KV-connector plugin over kvstream's layer-wise connector.

    KVTransferConfig(kv_connector="KvstreamConnector",
                     kv_connector_module_path="kvstream.vllm", kv_role="kv_producer", ...)

Importing this module imports vLLM (it subclasses vLLM's KVConnectorBase_V1) but not
kvstream's native module, which the connector's constructor loads. Written against vLLM
0.33.0 (VLLM_NOTES.md maps its connector interface onto kvstream's; docs/python.md has
the deployment and the kv_transfer_params a proxy passes).
"""

from kvstream.vllm.connector import KvstreamConnector
from kvstream.vllm.messages import (
    KvstreamConnectorMetadata,
    KvstreamConnectorStats,
    KvstreamWorkerMetadata,
)

__all__ = [
    "KvstreamConnector",
    "KvstreamConnectorMetadata",
    "KvstreamConnectorStats",
    "KvstreamWorkerMetadata",
]
