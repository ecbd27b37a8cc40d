# Unit tests: transports (loopback, UCX)
kvstream_add_gtest(loopback_transport_test LABELS unit SOURCES loopback_transport_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(ucx_transport_test LABELS unit SOURCES ucx_transport_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(copy_pool_test LABELS unit SOURCES copy_pool_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(transport_factory_test LABELS unit SOURCES transport_factory_test.cc
                   DEPS kvstream::transfer)
# cuda_ipc: its wire formats and what it does without a GPU (its GPU tests are in tests/gpu/).
kvstream_add_gtest(cuda_ipc_wire_test LABELS unit SOURCES cuda_ipc_wire_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(cuda_ipc_transport_test LABELS unit SOURCES cuda_ipc_transport_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(ucx_staged_test LABELS unit SOURCES ucx_staged_test.cc
                   DEPS kvstream::transfer)
target_include_directories(ucx_staged_test PRIVATE ${PROJECT_SOURCE_DIR}/transfer/src)
# The UCX configuration derived from the transport's options (ucx/ucx_setup.h).
kvstream_add_gtest(ucx_setup_test LABELS unit SOURCES ucx_setup_test.cc
                   DEPS kvstream::transfer)
target_include_directories(ucx_setup_test PRIVATE ${PROJECT_SOURCE_DIR}/transfer/src)
# Host writes as active messages over TCP (ucx/am_writes.h).
kvstream_add_gtest(ucx_am_writes_test LABELS unit SOURCES ucx_am_writes_test.cc
                   DEPS kvstream::transfer)
target_include_directories(ucx_am_writes_test PRIVATE ${PROJECT_SOURCE_DIR}/transfer/src)
# The check of a peer's mapped memory against this process's mappings (ucx/remote_mapping.h).
kvstream_add_gtest(ucx_remote_mapping_test LABELS unit SOURCES ucx_remote_mapping_test.cc
                   DEPS kvstream::transfer)
# What cuda_ipc and nccl share (transfer/src/transfer_table.h, peer_error_reports.h); nccl:
# its wire formats, batch planner, communicator state machine, and what it does without a
# second GPU (its two-GPU tests are in tests/gpu/).
foreach(t transfer_table_test peer_error_reports_test nccl_wire_test nccl_plan_test
          nccl_comm_state_test nccl_transport_test)
  kvstream_add_gtest(${t} LABELS unit SOURCES ${t}.cc DEPS kvstream::transfer)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/transfer/src)
endforeach()
