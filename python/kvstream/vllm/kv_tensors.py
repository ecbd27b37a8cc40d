"""vLLM's per-layer KV cache tensors as kvstream caches, without copying.

vLLM 0.33 hands register_kv_caches one tensor per attention layer, each a view into one
int8 allocation that all layers share, of logical shape [num_blocks, num_kv_heads,
block_size, head_size + head_size_v] in the cache dtype, with strides set by the KV cache
layout (LBHNC: a block's heads outside its tokens; LBNHC: tokens outside heads). What the
last dimension holds depends on the attention backend, not on the layout:

  "channels" (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER): K and V side by side in
      it: t.transpose(1, 2).split(head_size, -1) gives K and V as [blocks, tokens, heads, D]
  "rows" (CPU_ATTN): a block's page of one head, [block_size, 2 * D], read as [2 *
      block_size, D]: the block's keys, then its values

kvstream's KvCache.borrow takes K and V as separate logical [blocks, tokens, heads, D]
views with any strides, so both become two strided views into vLLM's memory; kvstream
registers their extents with the transport (they overlap; the transports allow it) and
writes exactly the bytes vLLM's kernels read. Both engines of a pair must run the same
backend family, layout and dtype: kvstream's handshake compares the specs and strides'
layout, and the model fingerprint (model_fingerprint) names the format.
"""

from __future__ import annotations

from typing import Any

CHANNELS = "channels"
ROWS = "rows"

BACKEND_FORMATS = {
    "CPU_ATTN": ROWS,
    "FLASH_ATTN": CHANNELS,
    "TRITON_ATTN": CHANNELS,
    "FLEX_ATTENTION": CHANNELS,
    "FLASHINFER": CHANNELS,
}


def backend_format(backend_name: str) -> str:
    fmt = BACKEND_FORMATS.get(backend_name.upper())
    if fmt is None:
        raise NotImplementedError(
            f"kvstream.vllm: the KV cache format of attention backend '{backend_name}' is "
            f"not known (supported: {', '.join(sorted(BACKEND_FORMATS))})")
    return fmt


def layer_backend_name(vllm_config, layer_name: str, override: str | None) -> str:
    """The attention backend of `layer_name`: the override (kv_connector_extra_config
    attention_backend), else the layer's own (vLLM's forward context holds the Attention
    layers by name), else the configured one."""
    if override:
        return override.upper()
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    layer = layers.get(layer_name)
    if layer is not None and hasattr(layer, "get_attn_backend"):
        return layer.get_attn_backend().get_name()
    configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if configured is not None:
        return getattr(configured, "name", str(configured))
    raise ValueError(
        f"kvstream.vllm: cannot tell the attention backend of layer '{layer_name}' (it is "
        "not in vLLM's forward context and none is configured); set "
        "kv_connector_extra_config.attention_backend")


def kvstream_dtype(tensor, cache_dtype: str) -> tuple[str, str]:
    """(kvstream dtype, quant_mode) of a vLLM cache tensor of cache_config.cache_dtype."""
    import torch

    name = (cache_dtype or "auto").lower()
    if name.startswith("fp8"):
        # vLLM keeps fp8 caches as uint8 (or a float8 dtype) with scales on the layer;
        # kvstream moves the bytes, its per-tensor scale is never used.
        return ("fp8_e5m2" if "e5m2" in name else "fp8_e4m3"), "per_tensor"
    by_torch = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if tensor.dtype not in by_torch:
        raise NotImplementedError(
            f"kvstream.vllm: KV cache dtype {tensor.dtype} (cache_dtype '{cache_dtype}')")
    return by_torch[tensor.dtype], "none"


def _raw(t):
    """The same memory as an unsigned integer tensor of the element's width: DLPack has no
    code for bfloat16 or fp8 on every torch, and kvstream takes raw storage of the width."""
    import torch

    raw = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[t.element_size()]
    return t if t.dtype == raw else t.view(raw)


def borrow_layer(tensor, fmt: str, cache_dtype: str):
    """A kvstream.KvCache over one layer's vLLM tensor (4-D, [blocks, heads, block_size,
    2 * head_size]), in backend format `fmt`. NotImplementedError for shapes kvstream
    cannot express (MLA's 3-D caches, K and V of different sizes)."""
    import kvstream

    if tensor.dim() != 4:
        raise NotImplementedError(
            f"kvstream.vllm: a {tensor.dim()}-D KV cache tensor of shape "
            f"{tuple(tensor.shape)} (MLA and other non-paged-attention caches are not "
            "supported)")
    num_blocks, heads, block_size, channels = tensor.shape
    if channels % 2:
        raise NotImplementedError(
            f"kvstream.vllm: K and V of different head sizes ({channels} channels)")
    d = channels // 2
    dtype, quant = kvstream_dtype(tensor, cache_dtype)
    spec = kvstream.KvCacheSpec(block_size=block_size, num_kv_heads=heads, head_size=d,
                                dtype=dtype, quant_mode=quant)
    raw = _raw(tensor)
    if fmt == CHANNELS:
        t = raw.transpose(1, 2)  # [blocks, tokens, heads, 2D]
        k, v = t[..., :d], t[..., d:]
    elif fmt == ROWS:
        if raw.stride(2) != channels or raw.stride(3) != 1:
            raise ValueError(
                "kvstream.vllm: the CPU attention backend's KV cache needs each head's "
                f"[block_size, 2 * head_size] rows contiguous (strides {raw.stride()})")
        rows = raw.view(num_blocks, heads, 2 * block_size, d)
        k = rows[:, :, :block_size].transpose(1, 2)
        v = rows[:, :, block_size:].transpose(1, 2)
    else:
        raise ValueError(f"kvstream.vllm: unknown KV cache format '{fmt}'")
    return kvstream.KvCache.borrow(spec, k, v)


def borrow_kv_caches(kv_caches: dict[str, Any], vllm_config, override: str | None):
    """{layer name: KvCache} for vLLM's {layer name: tensor}; every layer's backend
    format resolved as layer_backend_name says."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    out = {}
    for name, tensor in kv_caches.items():
        fmt = backend_format(layer_backend_name(vllm_config, name, override))
        out[name] = borrow_layer(tensor, fmt, cache_dtype)
    return out


def model_fingerprint(vllm_config, kv_caches: dict[str, Any], override: str | None) -> str:
    """What both engines of a pair must agree on beyond kvstream's own cache spec: the
    model's architecture and shapes, and the KV format vLLM's backend uses."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [getattr(hf, "model_type", "?")])
    formats = sorted({backend_format(layer_backend_name(vllm_config, n, override))
                      for n in kv_caches})
    return (f"vllm {arch} layers={getattr(hf, 'num_hidden_layers', '?')} "
            f"hidden={getattr(hf, 'hidden_size', '?')} dtype={mc.dtype} "
            f"kv_format={'+'.join(formats)} kv_cache_dtype="
            f"{getattr(vllm_config.cache_config, 'cache_dtype', 'auto')}")
