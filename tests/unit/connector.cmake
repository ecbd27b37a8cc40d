# Unit tests: connector (config, layer names, block copy plans, LayerwiseConnector over the
# loopback transport with a real TCP control channel).
kvstream_add_gtest(connector_config_test LABELS unit SOURCES connector_config_test.cc DEPS kvstream::connector)
kvstream_add_gtest(block_copy_plan_test LABELS unit SOURCES block_copy_plan_test.cc DEPS kvstream::connector)
kvstream_add_gtest(layerwise_connector_test LABELS unit SOURCES layerwise_connector_test.cc DEPS kvstream::connector)
kvstream_add_gtest(connector_codec_test LABELS unit SOURCES connector_codec_test.cc DEPS kvstream::connector)
kvstream_add_gtest(connector_scheduler_test LABELS unit SOURCES connector_scheduler_test.cc DEPS kvstream::connector)
kvstream_add_gtest(connector_fault_test LABELS unit SOURCES connector_fault_test.cc
  DEPS kvstream::connector kvstream_testing_faulty_transport)
kvstream_add_gtest(peer_lifecycle_test LABELS unit SOURCES peer_lifecycle_test.cc DEPS kvstream::connector)
