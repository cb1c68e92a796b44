# check_cli.cmake — runs amdemo once and checks its exit code and output
# (CTest alone can check one or the other, not both).
#   cmake -DEXE=... -DARGS="a;b" -DEXPECT_RC=2 -DEXPECT_OUT=regex
#         [-DEXPECT_FILE=path] [-DFORBID_OUT=regex] [-DPRE_MKDIR=dir]
#         [-DSTDOUT_FILE=path] [-DKEEP_FILE=path] -P check_cli.cmake
# FORBID_OUT: the output must not match it; PRE_MKDIR: a directory made
# before the run; STDOUT_FILE: standard output goes there (e.g. /dev/full);
# KEEP_FILE: a file written before the run that must be unchanged after it.
if(DEFINED EXPECT_FILE)
  file(REMOVE "${EXPECT_FILE}")
endif()
if(DEFINED PRE_MKDIR)
  file(MAKE_DIRECTORY "${PRE_MKDIR}")
endif()
if(DEFINED KEEP_FILE)
  file(WRITE "${KEEP_FILE}" "previous contents\n")
endif()
if(DEFINED STDOUT_FILE)
  execute_process(COMMAND ${EXE} ${ARGS} OUTPUT_FILE "${STDOUT_FILE}"
    RESULT_VARIABLE rc ERROR_VARIABLE err)
  set(out "")
else()
  execute_process(COMMAND ${EXE} ${ARGS}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
endif()
message("exit code ${rc}\n--- stdout\n${out}--- stderr\n${err}")
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "expected exit code ${EXPECT_RC}, got ${rc}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_OUT}")
  message(FATAL_ERROR "output does not match '${EXPECT_OUT}'")
endif()
if(DEFINED FORBID_OUT AND "${out}${err}" MATCHES "${FORBID_OUT}")
  message(FATAL_ERROR "output matches '${FORBID_OUT}', which it must not")
endif()
if(DEFINED EXPECT_FILE AND NOT EXISTS "${EXPECT_FILE}")
  message(FATAL_ERROR "expected file ${EXPECT_FILE} was not written")
endif()
if(DEFINED KEEP_FILE)
  file(READ "${KEEP_FILE}" kept)
  if(NOT kept STREQUAL "previous contents\n")
    message(FATAL_ERROR "${KEEP_FILE} was replaced")
  endif()
endif()
