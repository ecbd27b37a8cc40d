"""Cache specs and caches over caller-owned arrays (no copy), on the CPU."""

import numpy as np
import pytest

import kvstream


def spec(dtype="float32", head_size_v=0):
    return kvstream.KvCacheSpec(block_size=4, num_kv_heads=2, head_size=8,
                                head_size_v=head_size_v, dtype=dtype)


def test_spec_fields_and_sizes():
    s = spec(head_size_v=4)
    assert (s.block_size, s.num_kv_heads, s.head_size, s.head_size_v) == (4, 2, 8, 4)
    assert s.dtype == "float32" and s.quant_mode == "none"
    assert s.bytes_per_token == 2 * (8 + 4) * 4
    assert s.bytes_per_block == s.bytes_per_token * 4
    assert s.k_bytes_per_block + s.v_bytes_per_block == s.bytes_per_block
    assert spec() == spec(head_size_v=8)  # head_size_v 0 means head_size
    assert kvstream.resolve_kv_cache_dtype("auto", "float16") == "float16"
    assert kvstream.resolve_kv_cache_dtype("fp8") == "fp8_e4m3"


def test_borrow_is_the_callers_memory():
    k = np.zeros((16, 4, 2, 8), np.float32)
    v = np.zeros((16, 4, 2, 8), np.float32)
    cache = kvstream.KvCache.borrow(spec(), k, v)
    assert cache.k is k and cache.v is v
    assert not cache.owned and cache.memory == "host" and cache.num_blocks == 16
    assert cache.layout == "NHD"
    assert cache.spec == spec()


def test_borrow_hnd_and_strided_views():
    # HND: a permuted view of [blocks, heads, tokens, dim].
    k = np.zeros((16, 2, 4, 8), np.float32).transpose(0, 2, 1, 3)
    v = np.zeros((16, 2, 4, 8), np.float32).transpose(0, 2, 1, 3)
    assert kvstream.KvCache.borrow(spec(), k, v).layout == "HND"
    # Heads padded to 16 elements inside a larger array: neither dense layout, still a cache.
    big = np.zeros((16, 4, 2, 16), np.float32)
    cache = kvstream.KvCache.borrow(spec(), big[..., :8], big[..., 8:])
    assert cache.layout is None


def test_borrow_sub_range_of_a_larger_buffer():
    # Like PyTorch's caching allocator: the cache is a slice in the middle of an allocation.
    n = 16 * 4 * 2 * 8
    buffer = np.zeros(3 * n + 7, np.float32)
    k = buffer[5:5 + n].reshape(16, 4, 2, 8)
    v = buffer[5 + n:5 + 2 * n].reshape(16, 4, 2, 8)
    cache = kvstream.KvCache.borrow(spec(), k, v)
    assert cache.k is k
    assert np.shares_memory(cache.k, buffer)


def test_raw_unsigned_storage_for_dtypes_numpy_lacks():
    k = np.zeros((16, 4, 2, 8), np.uint16)
    cache = kvstream.KvCache.borrow(spec("bfloat16"), k, k.copy())
    assert cache.spec.dtype == "bfloat16"
    with pytest.raises(kvstream.InvalidArgumentError, match="uint8"):
        kvstream.KvCache.borrow(spec("bfloat16"), k.view(np.uint8)[..., :8], k)


def test_owned_cache_arrays_share_its_memory():
    cache = kvstream.KvCache.create(spec(), num_blocks=8, layout="HND")
    assert cache.owned and cache.layout == "HND"
    k = np.from_dlpack(cache.k)
    assert k.shape == (8, 4, 2, 8) and not k.any()
    k[3, 1, 0, :] = 7.0
    again = np.from_dlpack(cache.k)
    assert again[3, 1, 0, 0] == 7.0
    del cache  # the arrays keep the memory alive
    assert again[3, 1, 0, 7] == 7.0


def test_fp8_scales():
    s = kvstream.KvCacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp8_e4m3",
                             quant_mode="per_head")
    cache = kvstream.KvCache.create(s, num_blocks=2)
    cache.set_scales([0.5, 0.25], [1.0, 2.0])
    assert cache.k_scales == [0.5, 0.25] and cache.v_scales == [1.0, 2.0]
    with pytest.raises(kvstream.InvalidArgumentError):
        cache.set_scales([0.5], [1.0])  # per head needs one per KV head
    with pytest.raises(kvstream.FailedPreconditionError):
        kvstream.KvCache.create(spec(), 2).set_scales([1.0], [1.0])


def test_torch_tensors_if_installed():
    torch = pytest.importorskip("torch")
    big = torch.zeros(2 * 16 * 4 * 2 * 8 + 64, dtype=torch.bfloat16)
    n = 16 * 4 * 2 * 8
    k = big[32:32 + n].view(16, 4, 2, 8)
    v = big[32 + n:32 + 2 * n].view(16, 4, 2, 8)
    cache = kvstream.KvCache.borrow(spec("bfloat16"), k, v)
    assert cache.k is k and cache.layout == "NHD"
