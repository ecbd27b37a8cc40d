# Prefill and decode workers as real processes (and under mpirun).
foreach(scenario shm shm-copy one-at-a-time tcp mismatch mismatch-pp not-disaggregated kill-producer kill-producer-pp
        kill-consumer kill-consumer-copy metrics metrics-pp)
  add_test(NAME worker_${scenario}
    COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_workers.sh $<TARGET_FILE:kvstream_cli> ${scenario})
  set_tests_properties(worker_${scenario} PROPERTIES LABELS integration TIMEOUT 300
    PASS_REGULAR_EXPRESSION "PASS: ${scenario}")
endforeach()
# The same over the CUDA model on GPU 0 (label gpu; skips where no GPU can be used).
foreach(scenario cuda demo-cuda)
  add_test(NAME worker_${scenario}
    COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_workers.sh $<TARGET_FILE:kvstream_cli> ${scenario})
  set_tests_properties(worker_${scenario} PROPERTIES LABELS gpu TIMEOUT 300
    PASS_REGULAR_EXPRESSION "PASS: ${scenario}" SKIP_REGULAR_EXPRESSION "SKIPPED")
endforeach()
find_program(MPIRUN mpirun)
if(MPIRUN)
  foreach(scenario mpirun-1p2d mpirun-2p1d mpirun-1p2d-pp)
    add_test(NAME worker_${scenario}
      COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_workers.sh $<TARGET_FILE:kvstream_cli> ${scenario})
    set_tests_properties(worker_${scenario} PROPERTIES LABELS "integration;mpi" TIMEOUT 300
      PASS_REGULAR_EXPRESSION "PASS: ${scenario}")
  endforeach()
  add_test(NAME worker_mpirun-cuda
    COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_workers.sh $<TARGET_FILE:kvstream_cli> mpirun-cuda)
  set_tests_properties(worker_mpirun-cuda PROPERTIES LABELS "gpu;mpi" TIMEOUT 300
    PASS_REGULAR_EXPRESSION "PASS: mpirun-cuda" SKIP_REGULAR_EXPRESSION "SKIPPED")
  add_test(NAME worker_mpirun
    COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_workers.sh $<TARGET_FILE:kvstream_cli> mpirun)
  set_tests_properties(worker_mpirun PROPERTIES LABELS "integration;mpi" TIMEOUT 300
    PASS_REGULAR_EXPRESSION "PASS: mpirun")
else()
  message(STATUS "kvstream: mpirun not found; the mpirun worker test is not registered")
endif()
