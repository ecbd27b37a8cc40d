"""The attention layer's forward on the CPU over a cache borrowed from a view into a larger
buffer, against a numpy reference; and the registry's transfer hook."""

import numpy as np
import pytest

import kvstream

BLOCK = 4
HEADS, KV_HEADS, D = 4, 2, 8
NUM_BLOCKS = 8
NAME = "model.layers.0.self_attn.attn"


def make_layer(registry, **kw):
    return kvstream.Attention(registry, num_heads=HEADS, head_size=D, scale=D ** -0.5,
                              num_kv_heads=KV_HEADS, prefix=NAME, dtype="float32",
                              block_size=BLOCK, **kw)


def strided_cache():
    """K and V padded per head inside one larger buffer, at an offset: a view, not dense."""
    buffer = np.zeros(2 * NUM_BLOCKS * BLOCK * KV_HEADS * 2 * D + 16, np.float32)
    body = buffer[16:].reshape(2, NUM_BLOCKS, BLOCK, KV_HEADS, 2 * D)
    spec = kvstream.KvCacheSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=D,
                                dtype="float32")
    return kvstream.KvCache.borrow(spec, body[0, ..., :D], body[1, ..., :D]), buffer


def reference(q, k, v, context_len):
    """Causal GQA attention of query rows at positions context_len.. over keys 0..len(k)-1."""
    out = np.zeros((q.shape[0], HEADS, D), np.float64)
    for t in range(q.shape[0]):
        pos = context_len + t
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            s = (k[:pos + 1, g] @ q[t, h]) * D ** -0.5
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:pos + 1, g]
    return out


def test_prefill_then_decode_matches_reference():
    rng = np.random.default_rng(7)
    registry = kvstream.LayerRegistry()
    layer = make_layer(registry)
    assert layer.layer_name == NAME and layer.kv_cache_spec.num_kv_heads == KV_HEADS
    cache, buffer = strided_cache()
    registry.bind_kv_cache(NAME, cache)
    blocks = [5, 2]
    keys = rng.standard_normal((7, KV_HEADS, D)).astype(np.float32)
    values = rng.standard_normal((7, KV_HEADS, D)).astype(np.float32)
    queries = rng.standard_normal((7, HEADS, D)).astype(np.float32)

    # Prefill of the first 6 tokens, the output written into a caller's array.
    md = kvstream.build_attention_metadata([(0, 6, blocks)], block_size=BLOCK)
    assert md.slot_mapping == [20, 21, 22, 23, 8, 9]
    registry.set_forward_context(md)
    out = np.zeros((6, HEADS * D), np.float32)
    got = layer.forward(queries[:6].reshape(6, -1), keys[:6].reshape(6, -1),
                        values[:6].reshape(6, -1), out)
    assert got is out
    np.testing.assert_allclose(out.reshape(6, HEADS, D), reference(queries[:6], keys, values, 0),
                               rtol=1e-5, atol=1e-5)
    # The keys landed in their slots of the caller's buffer.
    k = cache.k
    np.testing.assert_array_equal(k[5, 1], keys[1])
    np.testing.assert_array_equal(k[2, 1], keys[5])
    assert not buffer[:16].any()

    # Decode of token 6, reading the 6 cached tokens; the output allocated by kvstream.
    md = kvstream.build_attention_metadata([(6, 1, blocks)], block_size=BLOCK)
    registry.set_forward_context(md)
    out = layer.forward(queries[6:].reshape(1, -1), keys[6:].reshape(1, -1),
                        values[6:].reshape(1, -1))
    assert isinstance(out, np.ndarray) and out.shape == (1, HEADS * D)
    np.testing.assert_allclose(out.reshape(1, HEADS, D), reference(queries[6:], keys, values, 6),
                               rtol=1e-5, atol=1e-5)


def test_dummy_run_writes_zeros_and_touches_no_cache():
    registry = kvstream.LayerRegistry()
    layer = make_layer(registry)
    cache, buffer = strided_cache()
    registry.bind_kv_cache(NAME, cache)
    registry.set_forward_context(None)
    q = np.ones((3, HEADS * D), np.float32)
    kv = np.ones((3, KV_HEADS * D), np.float32)
    out = np.full((3, HEADS * D), 5.0, np.float32)
    layer.forward(q, kv, kv, out)
    assert not out.any() and not buffer.any()


def test_layer_errors():
    registry = kvstream.LayerRegistry()
    layer = make_layer(registry)
    with pytest.raises(kvstream.AlreadyExistsError, match=NAME):
        make_layer(registry)
    with pytest.raises(kvstream.InvalidArgumentError):
        kvstream.Attention(registry, num_heads=3, head_size=D, scale=0.1, num_kv_heads=2,
                           prefix="model.layers.1.attn")
    with pytest.raises(kvstream.NotFoundError):
        kvstream.Attention(registry, num_heads=HEADS, head_size=D, scale=0.1,
                           prefix="model.layers.2.attn", backend="tpu")
    md = kvstream.build_attention_metadata([(0, 2, [0])], block_size=BLOCK)
    registry.set_forward_context(md)
    q = np.ones((2, HEADS * D), np.float32)
    kv = np.ones((2, KV_HEADS * D), np.float32)
    with pytest.raises(kvstream.FailedPreconditionError):
        layer.forward(q, kv, kv)  # no cache bound
    cache, _ = strided_cache()
    registry.bind_kv_cache(NAME, cache)
    with pytest.raises(kvstream.InvalidArgumentError):
        layer.forward(q, np.ones((2, 3), np.float32), kv)
    del layer
    assert NAME not in registry  # the layer unregisters when it goes


def test_worker_as_the_transfer_hook():
    # A consumer worker with nothing to load: the hook's wait returns at once, the layer
    # runs; once the worker is closed the hook reports it instead of crashing.
    config = {"kv_connector": "LayerwiseConnector", "kv_role": "kv_consumer", "engine_id": "d",
              "kv_connector_extra_config": {"transport": "loopback"}}
    worker = kvstream.ConnectorWorker(config)
    registry = kvstream.LayerRegistry()
    layer = make_layer(registry)
    cache, _ = strided_cache()
    registry.bind_kv_cache(NAME, cache)
    worker.register_kv_caches({NAME: cache})
    registry.set_transfer_hook(worker)
    registry.set_forward_context(kvstream.build_attention_metadata([(0, 2, [0])], block_size=BLOCK))
    q = np.ones((2, HEADS * D), np.float32)
    kv = np.ones((2, KV_HEADS * D), np.float32)
    layer.forward(q, kv, kv)
    worker.close()
    with pytest.raises(kvstream.FailedPreconditionError, match="closed"):
        layer.forward(q, kv, kv)
    registry.set_transfer_hook(None)
    layer.forward(q, kv, kv)
