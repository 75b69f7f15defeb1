# Runs a command and checks its exit code and, optionally, its stdout/stderr against regexes.
#   cmake -DCOMMAND="prog|arg|arg" -DEXPECTED_EXIT=2 [-DSTDOUT_MATCHES=re] [-DSTDERR_MATCHES=re]
#         -P expect_exit.cmake
# Arguments are separated by "|" because add_test would split a ";" list into arguments.
#   [-DCLEAN_DIR=dir]: removed before the command runs
string(REPLACE "|" ";" command "${COMMAND}")
if(DEFINED CLEAN_DIR)
  file(REMOVE_RECURSE "${CLEAN_DIR}")
endif()
execute_process(COMMAND ${command} RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(report "command: ${command}\nexit code: ${exit_code}\nstdout:\n${out}\nstderr:\n${err}")
if(NOT exit_code STREQUAL "${EXPECTED_EXIT}")
  message(FATAL_ERROR "expected exit code ${EXPECTED_EXIT}\n${report}")
endif()
if(DEFINED STDOUT_MATCHES AND NOT out MATCHES "${STDOUT_MATCHES}")
  message(FATAL_ERROR "stdout does not match `${STDOUT_MATCHES}`\n${report}")
endif()
if(DEFINED STDERR_MATCHES AND NOT err MATCHES "${STDERR_MATCHES}")
  message(FATAL_ERROR "stderr does not match `${STDERR_MATCHES}`\n${report}")
endif()
