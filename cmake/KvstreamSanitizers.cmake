# Sanitized builds of kvstream (docs/reliability.md, "Sanitizers").
#
#   KVSTREAM_SANITIZE=address,undefined   ASan + UBSan, every UBSan finding fatal
#   KVSTREAM_SANITIZE=thread              TSan
#
# The flags go on everything this project compiles and links (kvstream's libraries, the
# kvstream command, the tests), not on the system libraries it links. Clang is expected (the
# sub-builds made by tests/sanitize/ use it); GCC accepts the same flags.
#
# TSan sees synchronization only in instrumented code: Debian's libabsl is not instrumented,
# so absl::Mutex would look like no lock at all. A thread build therefore needs an Abseil
# built with -fsanitize=thread first on CMAKE_PREFIX_PATH (tests/sanitize/ builds one from
# Debian's source package) and refuses the system one. OpenMP is off in a thread build: the
# OpenMP runtime is not instrumented either.
set(KVSTREAM_SANITIZE "" CACHE STRING
    "Build with sanitizers: empty (none), address,undefined or thread")
set_property(CACHE KVSTREAM_SANITIZE PROPERTY STRINGS "" "address,undefined" "thread")

# Called after find_package(absl): in a thread build, the Abseil found must be instrumented.
function(kvstream_check_sanitized_absl)
  if(NOT KVSTREAM_SANITIZE STREQUAL "thread")
    return()
  endif()
  if(NOT EXISTS "${absl_DIR}/../../../share/kvstream-sanitize/abseil-tsan")
    message(FATAL_ERROR
      "KVSTREAM_SANITIZE=thread found the Abseil in ${absl_DIR}, which is not built with "
      "-fsanitize=thread: TSan would report every absl::Mutex as no lock. Put an instrumented "
      "Abseil first on CMAKE_PREFIX_PATH (the tsan sub-build of tests/sanitize/ does).")
  endif()
endfunction()

if(KVSTREAM_SANITIZE STREQUAL "")
  return()
endif()
if(NOT KVSTREAM_SANITIZE MATCHES "^(address,undefined|address|undefined|thread)$")
  message(FATAL_ERROR "KVSTREAM_SANITIZE=${KVSTREAM_SANITIZE}: use address,undefined, "
                      "address, undefined or thread")
endif()
if(KVSTREAM_HAVE_CUDA)
  message(FATAL_ERROR "KVSTREAM_SANITIZE needs -DKVSTREAM_CUDA=OFF (device code is not "
                      "instrumented, and the CUDA runtime's mappings clash with the shadow memory)")
endif()

# Frame pointers and line tables keep the reports' stacks readable at little cost. -O1 (after
# the build type's -O3, so it wins) is what the sanitizers' documentation suggests: these
# builds exist to find bugs, and it compiles in about half the time.
set(kvstream_sanitize_flags -fsanitize=${KVSTREAM_SANITIZE} -fno-omit-frame-pointer -g1 -O1)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  # The instrumentation keeps clang from vectorizing the `omp simd` loops of the CPU
  # attention kernels, which it reports as a warning (an error with -Werror).
  list(APPEND kvstream_sanitize_flags -Wno-pass-failed)
endif()
if(KVSTREAM_SANITIZE MATCHES "undefined")
  # A UBSan finding stops the process with a non-zero status, so the test fails.
  list(APPEND kvstream_sanitize_flags -fno-sanitize-recover=undefined)
endif()
add_compile_options(${kvstream_sanitize_flags})
add_link_options(-fsanitize=${KVSTREAM_SANITIZE})

if(KVSTREAM_SANITIZE STREQUAL "thread")
  set(CMAKE_DISABLE_FIND_PACKAGE_OpenMP ON)
endif()
message(STATUS "kvstream: sanitizers ${KVSTREAM_SANITIZE}")
