# GPU tests of the nccl transport: two processes on two GPUs (this test on GPU 0 and the
# receiver program it forks and execs, on GPU 1). They skip, saying why, where fewer than
# two GPUs are visible or kvstream was built without NCCL. Both set NCCL_NVLS_ENABLE=0.
add_executable(kvstream_nccl_peer nccl_peer_main.cc)
target_link_libraries(kvstream_nccl_peer PRIVATE kvstream::transfer CUDA::cudart)
target_include_directories(kvstream_nccl_peer PRIVATE ${PROJECT_SOURCE_DIR})
kvstream_set_warnings(kvstream_nccl_peer)

kvstream_add_gtest(nccl_transport_gpu_test LABELS gpu
  SOURCES nccl_transport_gpu_test.cc
  DEPS kvstream::transfer kvstream::common kvstream_gpu_test_kernels CUDA::cudart)
target_include_directories(nccl_transport_gpu_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                           ${PROJECT_SOURCE_DIR}/transfer/src)
target_compile_definitions(nccl_transport_gpu_test PRIVATE
  KVSTREAM_NCCL_PEER_BINARY="$<TARGET_FILE:kvstream_nccl_peer>")
add_dependencies(nccl_transport_gpu_test kvstream_nccl_peer)
