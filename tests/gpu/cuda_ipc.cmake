# GPU tests of the cuda_ipc transport: two processes on one GPU (this test and the peer
# program it forks and execs).
add_executable(kvstream_cuda_ipc_peer cuda_ipc_peer_main.cc)
target_link_libraries(kvstream_cuda_ipc_peer PRIVATE kvstream_gpu_transport_peer)
target_include_directories(kvstream_cuda_ipc_peer PRIVATE ${PROJECT_SOURCE_DIR})
kvstream_set_warnings(kvstream_cuda_ipc_peer)

kvstream_add_gtest(cuda_ipc_transport_gpu_test LABELS gpu
  SOURCES cuda_ipc_transport_gpu_test.cc
  DEPS kvstream_gpu_transport_pair kvstream::common kvstream_gpu_test_kernels CUDA::cudart)
target_include_directories(cuda_ipc_transport_gpu_test PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_definitions(cuda_ipc_transport_gpu_test PRIVATE
  KVSTREAM_CUDA_IPC_PEER_BINARY="$<TARGET_FILE:kvstream_cuda_ipc_peer>")
add_dependencies(cuda_ipc_transport_gpu_test kvstream_cuda_ipc_peer)
