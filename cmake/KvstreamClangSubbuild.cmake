# Sub-builds of this source tree with clang, made during this build (ExternalProject): the
# libFuzzer targets (tests/fuzz/) and the sanitized builds (tests/sanitize/) need clang and
# its runtimes whatever compiler the main build uses.
#
# kvstream_find_clang(<out_var>)
#   Sets KVSTREAM_CLANGXX and KVSTREAM_CLANG (cache) and <out_var> to TRUE when both exist.
#   The main build's own compiler is used when it is clang.
#
# kvstream_add_clang_subbuild(<name> BINARY_DIR <dir> [CMAKE_ARGS <args...>]
#                             [BUILD_ARGS <args...>] [DEPENDS <targets...>])
#   Target <name>: configures this source tree in <dir> with clang (Release, no CUDA, no
#   benchmarks, no Python tests, the main build's compiler launcher) plus CMAKE_ARGS, and builds it on every
#   build of the main one (`cmake --build <dir> BUILD_ARGS`); nothing is installed.
include(ExternalProject)

function(kvstream_find_clang out_var)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND CMAKE_C_COMPILER_ID MATCHES "Clang")
    set(KVSTREAM_CLANGXX ${CMAKE_CXX_COMPILER} CACHE FILEPATH "clang++ for the clang sub-builds")
    set(KVSTREAM_CLANG ${CMAKE_C_COMPILER} CACHE FILEPATH "clang for the clang sub-builds")
  else()
    find_program(KVSTREAM_CLANGXX NAMES clang++ clang++-14)
    find_program(KVSTREAM_CLANG NAMES clang clang-14)
  endif()
  if(KVSTREAM_CLANGXX AND KVSTREAM_CLANG)
    set(${out_var} TRUE PARENT_SCOPE)
  else()
    set(${out_var} FALSE PARENT_SCOPE)
  endif()
endfunction()

function(kvstream_add_clang_subbuild name)
  cmake_parse_arguments(ARG "" "BINARY_DIR" "CMAKE_ARGS;BUILD_ARGS;DEPENDS" ${ARGN})
  set(depends "")
  if(ARG_DEPENDS)
    set(depends DEPENDS ${ARG_DEPENDS})
  endif()
  ExternalProject_Add(${name}
    SOURCE_DIR ${PROJECT_SOURCE_DIR}
    BINARY_DIR ${ARG_BINARY_DIR}
    CMAKE_ARGS -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${KVSTREAM_CLANGXX}
               -DCMAKE_C_COMPILER=${KVSTREAM_CLANG} -DKVSTREAM_CUDA=OFF
               -DKVSTREAM_BUILD_BENCHMARKS=OFF -DKVSTREAM_PYTHON_TESTS=OFF
               -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
               ${ARG_CMAKE_ARGS}
    BUILD_COMMAND ${CMAKE_COMMAND} --build <BINARY_DIR> ${ARG_BUILD_ARGS}
    INSTALL_COMMAND ""
    BUILD_ALWAYS ON
    EXCLUDE_FROM_ALL OFF
    ${depends})
endfunction()
