# Unit tests: cache (spec and layouts, block pool, KV cache buffers, slot mapping, cache
# update, layer checksum).
kvstream_add_gtest(kv_cache_spec_test LABELS unit SOURCES kv_cache_spec_test.cc
                   DEPS kvstream::cache)
kvstream_add_gtest(block_pool_test LABELS unit SOURCES block_pool_test.cc DEPS kvstream::cache)
kvstream_add_gtest(kv_cache_test LABELS unit SOURCES kv_cache_test.cc DEPS kvstream::cache)
kvstream_add_gtest(slot_mapping_test LABELS unit SOURCES slot_mapping_test.cc
                   DEPS kvstream::cache)
kvstream_add_gtest(cache_update_test LABELS unit SOURCES cache_update_test.cc
                   DEPS kvstream::cache)
kvstream_add_gtest(layer_checksum_test LABELS unit SOURCES layer_checksum_test.cc
                   DEPS kvstream::cache)
