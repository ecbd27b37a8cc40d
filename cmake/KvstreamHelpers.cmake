# kvstream_add_library(<folder>
#     SOURCES <files...> [CUDA_SOURCES <files...>]
#     DEPS <public targets...> [PRIVATE_DEPS <targets...>])
#
# Declares the library of one top-level folder: target kvstream_<folder>, alias
# kvstream::<folder>, public headers in <folder>/include/kvstream/<folder>/, installed
# and exported under the kvstream:: namespace. CUDA sources are added only when
# KVSTREAM_HAVE_CUDA is on.
include(GNUInstallDirs)

set(KVSTREAM_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unused-parameter)

function(kvstream_set_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVSTREAM_WARNINGS}>)
  if(KVSTREAM_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                             $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings>)
  endif()
endfunction()

function(kvstream_add_library folder)
  # INTERNAL: a library of the command and the tests, not installed or exported.
  cmake_parse_arguments(ARG "INTERNAL" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target kvstream_${folder})
  set(sources ${ARG_SOURCES})
  if(KVSTREAM_HAVE_CUDA)
    list(APPEND sources ${ARG_CUDA_SOURCES})
  endif()
  add_library(${target} ${sources})
  add_library(kvstream::${folder} ALIAS ${target})
  set_target_properties(${target} PROPERTIES
    EXPORT_NAME ${folder}
    OUTPUT_NAME kvstream_${folder}
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(KVSTREAM_HAVE_CUDA)
    set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  endif()
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_compile_features(${target} PUBLIC cxx_std_17)
  target_link_libraries(${target} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  kvstream_set_warnings(${target})
  if(ARG_INTERNAL)
    return()
  endif()
  install(TARGETS ${target} EXPORT kvstreamTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endfunction()

# Sets KVSTREAM_OPENBLAS_TARGET to a target that provides OpenBLAS's CBLAS: pkg-config's
# openblas (Debian's libopenblas-dev), else OpenBLAS's CMake config; "" when neither is
# found. Called once, at the top level, so that every directory below sees the target.
macro(kvstream_find_openblas)
  set(KVSTREAM_OPENBLAS_TARGET "")
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(KVSTREAM_OPENBLAS QUIET IMPORTED_TARGET openblas)
    if(KVSTREAM_OPENBLAS_FOUND)
      set(KVSTREAM_OPENBLAS_TARGET PkgConfig::KVSTREAM_OPENBLAS)
    endif()
  endif()
  if(NOT KVSTREAM_OPENBLAS_TARGET)
    find_package(OpenBLAS CONFIG QUIET)
    if(OpenBLAS_FOUND)
      add_library(kvstream_openblas INTERFACE)
      target_include_directories(kvstream_openblas INTERFACE ${OpenBLAS_INCLUDE_DIRS})
      target_link_libraries(kvstream_openblas INTERFACE ${OpenBLAS_LIBRARIES})
      set(KVSTREAM_OPENBLAS_TARGET kvstream_openblas)
    endif()
  endif()
endmacro()
