# Benchmark: the UCX transport between two processes on this machine, beside ucx_perftest.
find_package(benchmark QUIET)
if(benchmark_FOUND)
  add_executable(kvstream_bench_transfer transfer_bench.cc)
  target_link_libraries(kvstream_bench_transfer PRIVATE kvstream::transfer benchmark::benchmark)
  kvstream_set_warnings(kvstream_bench_transfer)
endif()
