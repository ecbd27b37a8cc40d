# Unit tests: the Attention layer, its registry and metadata.
kvstream_add_gtest(metadata_test LABELS unit SOURCES metadata_test.cc DEPS kvstream::attention)
kvstream_add_gtest(layer_registry_test LABELS unit SOURCES layer_registry_test.cc DEPS kvstream::attention)
kvstream_add_gtest(attention_layer_test LABELS unit SOURCES attention_layer_test.cc DEPS kvstream::attention)
