# Integration tests: the UCX transport between real processes (a forked and exec'd peer
# program), over shared memory and TCP on loopback.
add_executable(kvstream_ucx_transport_peer ucx_transport_peer_main.cc)
target_link_libraries(kvstream_ucx_transport_peer PRIVATE kvstream::transfer)
target_include_directories(kvstream_ucx_transport_peer PRIVATE ${PROJECT_SOURCE_DIR})
kvstream_set_warnings(kvstream_ucx_transport_peer)

kvstream_add_gtest(ucx_transport_multiprocess_test LABELS integration
                   SOURCES ucx_transport_multiprocess_test.cc DEPS kvstream::transfer)
target_compile_definitions(ucx_transport_multiprocess_test PRIVATE
  KVSTREAM_UCX_PEER_BINARY="$<TARGET_FILE:kvstream_ucx_transport_peer>")
add_dependencies(ucx_transport_multiprocess_test kvstream_ucx_transport_peer)
