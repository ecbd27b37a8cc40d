"""kvstream: layer-wise KV-cache streaming for disaggregated LLM serving.

The C++ API through nanobind (see docs/python.md): cache specs and caches over arrays the
caller owns (DLPack: numpy, torch, cupy; no copy), the attention layer, and the KV
connector's scheduler side and worker side, whose messages are bytes. Every kvstream error
is a KvstreamError subclass that names its status code.

The native module (kvstream._kvstream, with UCX and, in CUDA builds, the CUDA runtime) is
loaded on first use of one of these names, not by `import kvstream`: vLLM imports the
plugin kvstream.vllm in processes that never move KV (its API server builds a VllmConfig,
which imports the connector's module), and those should not load it.
"""

import importlib

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "Attention",
    "AttentionMetadata",
    "CancelledError",
    "ConnectorScheduler",
    "ConnectorWorker",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "KvCache",
    "KvCacheSpec",
    "KvstreamError",
    "LayerRegistry",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "Request",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "attention_backend_names",
    "build_attention_metadata",
    "built_with_cuda",
    "decode_connector_metadata",
    "decode_connector_output",
    "encode_connector_metadata",
    "encode_connector_output",
    "kv_connector_names",
    "resolve_kv_cache_dtype",
]

_NATIVE = frozenset(__all__)


def __getattr__(name):
    if name in _NATIVE:
        value = getattr(importlib.import_module("kvstream._kvstream"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'kvstream' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | _NATIVE)
