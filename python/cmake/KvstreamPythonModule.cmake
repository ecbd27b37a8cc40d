# kvstream_python_module(<target> [OUTPUT_DIRECTORY <dir>])
#
# Declares the nanobind extension kvstream._kvstream (python/src/*.cc) as <target>, linked
# statically against kvstream's libraries (kvstream::common ... kvstream::connector), which
# must already be targets of this build. Two builds use it: the wheel (python/CMakeLists.txt,
# scikit-build-core, kvstream's libraries built for the wheel) and the main build's Python
# tests (python/tests/CMakeLists.txt, the libraries the main build already has). Needs
# find_package(Python ... Development.Module) and find_package(nanobind) first, and
# KVSTREAM_HAVE_CUDA / CUDAToolkit_LIBRARY_DIR passed in when the caller is not the root.
#
#   kvstream_python_module(_kvstream HAVE_CUDA ${on} CUDA_LIBRARY_DIR ${dir})
get_filename_component(KVSTREAM_PYTHON_DIR "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

function(kvstream_python_module target)
  cmake_parse_arguments(ARG "" "OUTPUT_DIRECTORY;HAVE_CUDA;CUDA_LIBRARY_DIR" "" ${ARGN})
  set(src ${KVSTREAM_PYTHON_DIR}/src)
  # NB_SUPPRESS_WARNINGS: nanobind's headers are system headers to our -Wshadow -Werror.
  nanobind_add_module(${target} NB_STATIC NB_SUPPRESS_WARNINGS
    ${src}/module.cc
    ${src}/errors.cc
    ${src}/tensors.cc
    ${src}/caches.cc
    ${src}/attention.cc
    ${src}/connector.cc
    ${src}/connector_messages.cc)
  # The module imports as kvstream._kvstream whatever the target is called.
  set_target_properties(${target} PROPERTIES OUTPUT_NAME _kvstream)
  target_include_directories(${target} PRIVATE ${src})
  target_link_libraries(${target} PRIVATE
    kvstream::common kvstream::cache kvstream::attention kvstream::transfer kvstream::connector)
  if(ARG_HAVE_CUDA)
    target_compile_definitions(${target} PRIVATE KVSTREAM_PYTHON_HAVE_CUDA)
    # libcudart is linked shared: find it where the toolkit is, also where the toolkit's
    # folder is not in the loader's path.
    if(ARG_CUDA_LIBRARY_DIR)
      set_target_properties(${target} PROPERTIES
        INSTALL_RPATH "${ARG_CUDA_LIBRARY_DIR}"
        BUILD_RPATH "${ARG_CUDA_LIBRARY_DIR}")
    endif()
  endif()
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIRECTORY}")
  endif()
  kvstream_set_warnings(${target})
endfunction()
