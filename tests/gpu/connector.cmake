# GPU test of the connector end to end with device caches: two processes on one GPU (this
# test, the decode side, and the prefill program it forks and execs).
add_executable(kvstream_connector_device_peer connector_device_gpu_peer_main.cc)
target_link_libraries(kvstream_connector_device_peer PRIVATE kvstream::connector
                      kvstream::attention CUDA::cudart)
target_include_directories(kvstream_connector_device_peer PRIVATE ${PROJECT_SOURCE_DIR})
kvstream_set_warnings(kvstream_connector_device_peer)

kvstream_add_gtest(connector_device_gpu_test LABELS gpu
  SOURCES connector_device_gpu_test.cc
  DEPS kvstream::connector kvstream::attention CUDA::cudart)
target_include_directories(connector_device_gpu_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_definitions(connector_device_gpu_test PRIVATE
  KVSTREAM_CONNECTOR_DEVICE_PEER_BINARY="$<TARGET_FILE:kvstream_connector_device_peer>")
add_dependencies(connector_device_gpu_test kvstream_connector_device_peer)
