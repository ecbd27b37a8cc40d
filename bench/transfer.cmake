# Benchmark: the UCX transport between two processes on this machine, beside ucx_perftest.
find_package(benchmark QUIET)
if(benchmark_FOUND)
  add_executable(kvstream_bench_transfer transfer_bench.cc)
  target_link_libraries(kvstream_bench_transfer PRIVATE kvstream::transfer benchmark::benchmark)
  kvstream_set_warnings(kvstream_bench_transfer)
endif()
# Benchmark: the cuda_ipc transport between two processes on one GPU, beside a contiguous
# device-to-device cudaMemcpyAsync of the same bytes (a plain main: no Google Benchmark).
if(KVSTREAM_HAVE_CUDA)
  add_executable(kvstream_bench_cuda_ipc cuda_ipc_bench.cc)
  target_link_libraries(kvstream_bench_cuda_ipc PRIVATE kvstream::transfer kvstream::common
                        CUDA::cudart)
  kvstream_set_warnings(kvstream_bench_cuda_ipc)
endif()
# Benchmark: the UCX staged device path between two processes on one GPU, beside the
# pinned copy ceiling measured in the same run (a plain program: it spawns its own peer).
if(KVSTREAM_HAVE_CUDA)
  add_executable(kvstream_bench_ucx_staged ucx_staged_bench.cc)
  target_link_libraries(kvstream_bench_ucx_staged PRIVATE kvstream::transfer CUDA::cudart)
  target_include_directories(kvstream_bench_ucx_staged PRIVATE ${PROJECT_SOURCE_DIR})
  kvstream_set_warnings(kvstream_bench_ucx_staged)
endif()
# Benchmark: the cuda_ipc copy kernel in one process by where the blocks lie (contiguous,
# shuffled in the layer, drawn from a larger pool, sorted), beside a contiguous memcpy.
if(KVSTREAM_HAVE_CUDA)
  add_executable(kvstream_bench_copy_pattern cuda_copy_pattern_bench.cu)
  target_link_libraries(kvstream_bench_copy_pattern PRIVATE kvstream::transfer CUDA::cudart)
  target_include_directories(kvstream_bench_copy_pattern PRIVATE ${PROJECT_SOURCE_DIR}/transfer/src)
  kvstream_set_warnings(kvstream_bench_copy_pattern)
endif()
# Benchmark: KV layers over one network link between two hosts (UCX over TCP), beside a
# plain TCP stream on the same link; bench/host_links.sh runs it between simulated hosts.
add_executable(kvstream_bench_link link_bench.cc)
target_link_libraries(kvstream_bench_link PRIVATE kvstream::transfer)
kvstream_set_warnings(kvstream_bench_link)
# Benchmark: the nccl transport from GPU 0 to GPU 1 (two processes), beside a raw contiguous
# ncclSend/ncclRecv of the same bytes in the same run (a plain program: it spawns its peer).
if(KVSTREAM_HAVE_NCCL)
  find_package(NCCL REQUIRED)  # its imported target is local to the directory that finds it
  add_executable(kvstream_bench_nccl nccl_bench.cc)
  target_link_libraries(kvstream_bench_nccl PRIVATE kvstream::transfer NCCL::NCCL CUDA::cudart)
  kvstream_set_warnings(kvstream_bench_nccl)
endif()
