# Applies Debian's quilt patches (PATCH_DIR/series, in order) to the Abseil source in
# SOURCE_DIR with PATCH, as dpkg-source would: the TSan build then matches the system's
# libabsl (its options.h, its security fixes). Run once, by ExternalProject's patch step.
file(STRINGS ${PATCH_DIR}/series patches REGEX "^[^#]")
foreach(p ${patches})
  string(STRIP "${p}" p)
  execute_process(COMMAND ${PATCH} -p1 --forward --batch -i ${PATCH_DIR}/${p}
                  WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "Debian patch ${p} does not apply to ${SOURCE_DIR}")
  endif()
endforeach()
