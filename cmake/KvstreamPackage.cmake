# Installs the exported CMake package so that another project can
#   find_package(kvstream CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE kvstream::kvstream)
include(CMakePackageConfigHelpers)
set(KVSTREAM_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvstream)
install(EXPORT kvstreamTargets NAMESPACE kvstream:: DESTINATION ${KVSTREAM_CMAKE_DIR})
configure_package_config_file(cmake/kvstreamConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/kvstreamConfig.cmake
  INSTALL_DESTINATION ${KVSTREAM_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/kvstreamConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/kvstreamConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/kvstreamConfigVersion.cmake
  ${CMAKE_CURRENT_SOURCE_DIR}/cmake/FindNCCL.cmake
  ${CMAKE_CURRENT_SOURCE_DIR}/cmake/FindXXHash.cmake
  DESTINATION ${KVSTREAM_CMAKE_DIR})
