"""What kvstream.vllm reads from vLLM's configuration: the kv_transfer_config dict that
kvstream's C++ sides are created from, and the plugin's own settings.

vLLM 0.33's KVTransferConfig has fewer fields than kvstream's parser knows (no kv_ip,
kv_rank, kv_parallel_size, kv_buffer_size) and one it does not (enable_permute_local_kv),
so the dict is built field by field rather than dumped. kv_connector_extra_config holds
kvstream's settings (docs/configuration.md) and, next to them, the plugin's (PLUGIN_KEYS),
which are taken out before kvstream sees the rest:

  kv_ip              producer: the address kvstream's control channel listens on
                     (default 127.0.0.1); also what request_finished tells the proxy
  handoff_wait_ms    producer: how long a request that names a transfer id waits for its
                     consumer's hand-off before it is prefilled without one (its KV then
                     goes out when the hand-off comes, from the blocks kept after the
                     prefill); default 200
  handoff_keep_ms    producer: how long a prefilled request's blocks are kept for a
                     hand-off that has not come; default 30000
  attention_backend  the attention backend whose KV cache format the tensors have
                     (CPU_ATTN, FLASH_ATTN, ...); default: asked of the layers

Nothing here imports vLLM or kvstream's native module; the config is read by attribute.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

# kvstream's C++ connector that the plugin drives (kvstream.kv_connector_names()).
KVSTREAM_CONNECTOR = "LayerwiseConnector"

PLUGIN_KEYS = ("kv_ip", "handoff_wait_ms", "handoff_keep_ms", "attention_backend")


@dataclass(frozen=True)
class PluginSettings:
    kv_ip: str = "127.0.0.1"
    handoff_wait_ms: float = 200.0
    handoff_keep_ms: float = 30000.0
    attention_backend: str | None = None


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"kvstream.vllm: kv_connector_extra_config.{key} must be a "
                         f"non-negative number of milliseconds, not {value!r}")
    return float(value)


def plugin_settings(kv_transfer_config) -> PluginSettings:
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    kv_ip = extra.get("kv_ip", PluginSettings.kv_ip)
    if not isinstance(kv_ip, str) or not kv_ip:
        raise ValueError(f"kvstream.vllm: kv_connector_extra_config.kv_ip must be an "
                         f"address, not {kv_ip!r}")
    backend = extra.get("attention_backend")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"kvstream.vllm: kv_connector_extra_config.attention_backend must "
                         f"be a backend name, not {backend!r}")
    return PluginSettings(
        kv_ip=kv_ip,
        handoff_wait_ms=_number(extra, "handoff_wait_ms", PluginSettings.handoff_wait_ms),
        handoff_keep_ms=_number(extra, "handoff_keep_ms", PluginSettings.handoff_keep_ms),
        attention_backend=backend,
    )


def kvstream_config(kv_transfer_config, *, tp_rank: int = 0, tp_size: int = 1) -> dict[str, Any]:
    """kvstream's kv_transfer_config for the worker of tensor-parallel rank `tp_rank`
    (the scheduler side: rank 0). Rank r's producer listens on kv_port + r (0 stays 0: any
    free port) and its engine id gets "-tp<r>" when tp_size > 1; a consumer of rank r
    hands its requests to the producer's rank r (WorkerSide rewrites the ports)."""
    c = kv_transfer_config
    extra = copy.deepcopy(dict(c.kv_connector_extra_config or {}))
    settings = plugin_settings(c)
    for key in PLUGIN_KEYS:
        extra.pop(key, None)
    device = c.kv_buffer_device or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"kvstream.vllm: kv_buffer_device '{device}' (kvstream moves KV "
                         "in cpu or cuda memory)")
    port = int(c.kv_port)
    if port != 0:
        port += tp_rank
    engine_id = str(c.engine_id)
    if tp_size > 1:
        engine_id = f"{engine_id}-tp{tp_rank}"
    return {
        "kv_connector": KVSTREAM_CONNECTOR,
        "kv_role": c.kv_role,
        "engine_id": engine_id,
        "kv_buffer_device": device,
        "kv_ip": settings.kv_ip,
        "kv_port": port,
        # vLLM's scheduler applies the policy (recompute or fail) itself; kvstream is told
        # the same so that its stats and logs agree.
        "kv_load_failure_policy": c.kv_load_failure_policy,
        "kv_connector_extra_config": extra,
    }


# What a request's kv_transfer_params may hold. The first two are vLLM's convention
# (NIXL's too); remote_host / remote_port name the producer's kvstream control address.
DO_REMOTE_PREFILL = "do_remote_prefill"  # consumer: the prompt's KV comes from a producer
DO_REMOTE_DECODE = "do_remote_decode"    # producer: send the prompt's KV to a consumer
TRANSFER_ID = "transfer_id"              # both: the id both engines know the request by


def transfer_params(request) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


# kvstream's producer knows a hand-off by "<consumer scope>/<escaped id>"; ids of these
# characters are their own escape, so the producer side can match them with its requests.
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:=+@~-]{1,128}")


def transfer_id(request, params: dict[str, Any]) -> str:
    """The id both engines' kvstream sides know the request by. vLLM gives a request a
    different id in each engine (the client's id with a random suffix), so the proxy
    passes one in kv_transfer_params; without it the engine's own request id is used,
    which only matches where both engines were given the same id."""
    tid = params.get(TRANSFER_ID)
    if tid is None:
        tid = str(request.request_id)
    if not isinstance(tid, str) or not _TRANSFER_ID.fullmatch(tid):
        raise ValueError(f"kvstream.vllm: transfer id {tid!r} (kv_transfer_params."
                         f"{TRANSFER_ID}, else the request id) must be 1-128 characters of "
                         "A-Z a-z 0-9 . _ : = + @ ~ -")
    return tid
