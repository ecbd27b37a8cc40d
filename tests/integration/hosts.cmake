# Workers on simulated hosts: network namespaces on a bridge (launch/sim_hosts.sh), ranks
# started in them by mpirun through launch/netns_rsh.sh. Needs root; skips where it is not
# root or namespaces cannot be made. The hosts' names and subnet are fixed per scenario, so
# the scenarios take one lock and run one at a time.
find_program(MPIRUN mpirun)
if(MPIRUN)
  foreach(scenario hosts-2p2d hosts-link-cut hosts-restart hosts-restart-same-port)
    add_test(NAME worker_${scenario}
      COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/run_hosts.sh $<TARGET_FILE:kvstream_cli> ${scenario})
    set_tests_properties(worker_${scenario} PROPERTIES LABELS "integration;mpi" TIMEOUT 300
      PASS_REGULAR_EXPRESSION "PASS: ${scenario}" SKIP_REGULAR_EXPRESSION "SKIPPED"
      RESOURCE_LOCK kvstream_sim_hosts)
  endforeach()
else()
  message(STATUS "kvstream: mpirun not found; the simulated-host tests are not registered")
endif()
