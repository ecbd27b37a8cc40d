"""kvstream.vllm: a vLLM KV-connector plugin over kvstream's layer-wise connector.

    KVTransferConfig(kv_connector="KvstreamConnector",
                     kv_connector_module_path="kvstream.vllm", kv_role="kv_producer", ...)

vLLM's factory takes the class by name from this module (getattr), which imports vLLM
(the class subclasses vLLM's KVConnectorBase_V1) but not kvstream's native module, which
the connector's constructor loads. The submodules that need neither (settings,
output_join) import without vLLM. Written against vLLM 0.33.0 (VLLM_NOTES.md maps its
connector interface onto kvstream's; docs/python.md has the deployment and the
kv_transfer_params a proxy passes).
"""

import importlib

_EXPORTS = {
    "KvstreamConnector": "kvstream.vllm.connector",
    "KvstreamConnectorMetadata": "kvstream.vllm.messages",
    "KvstreamConnectorStats": "kvstream.vllm.messages",
    "KvstreamWorkerMetadata": "kvstream.vllm.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstream.vllm' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
