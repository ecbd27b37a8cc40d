# Unit tests of serving/ (the CPU model, the engine, the stage link) and of the kvstream
# command's metrics rendering and how its workers find each other.
kvstream_add_gtest(toy_model_test LABELS unit SOURCES toy_model_test.cc DEPS kvstream::serving)
kvstream_add_gtest(engine_test LABELS unit SOURCES engine_test.cc DEPS kvstream::serving)
kvstream_add_gtest(pipeline_link_test LABELS unit SOURCES pipeline_link_test.cc DEPS kvstream::serving)
kvstream_add_gtest(metrics_server_test LABELS unit SOURCES metrics_server_test.cc DEPS kvstream_launch_internal)
kvstream_add_gtest(layer_overlap_test LABELS unit SOURCES layer_overlap_test.cc DEPS kvstream_launch_internal)
kvstream_add_gtest(worker_rendezvous_test LABELS unit SOURCES worker_rendezvous_test.cc DEPS kvstream_launch_internal)
