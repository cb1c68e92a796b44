# check_cli.cmake — runs amdemo once and checks its exit code and output
# (CTest alone can check one or the other, not both).
#   cmake -DEXE=... -DARGS="a;b" -DEXPECT_RC=2 -DEXPECT_OUT=regex
#         [-DEXPECT_FILE=path] -P check_cli.cmake
if(DEFINED EXPECT_FILE)
  file(REMOVE "${EXPECT_FILE}")
endif()
execute_process(COMMAND ${EXE} ${ARGS}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("exit code ${rc}\n--- stdout\n${out}--- stderr\n${err}")
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "expected exit code ${EXPECT_RC}, got ${rc}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_OUT}")
  message(FATAL_ERROR "output does not match '${EXPECT_OUT}'")
endif()
if(DEFINED EXPECT_FILE AND NOT EXISTS "${EXPECT_FILE}")
  message(FATAL_ERROR "expected file ${EXPECT_FILE} was not written")
endif()
