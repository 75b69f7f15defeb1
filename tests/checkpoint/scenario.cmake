# One checkpoint scenario (see CMakeLists.txt). Runs: an uninterrupted 10-step reference, then
# the damaged run, then a resume; checks exit codes, the surviving checkpoints, and that every
# loss of the resumed run equals the reference's at the same step (metrics.jsonl, full precision).
cmake_minimum_required(VERSION 3.19)  # string(JSON)
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(CKPT ${WORK}/checkpoints)

# train(run_dir expected_exit [command prefix...]); ${train_args} is appended to the command line.
set(train_args "")
function(train run_dir expected_exit)
  execute_process(COMMAND ${ARGN} ${MOETRAIN} train --config ${CONFIG} --set logging.run_dir=${WORK}/${run_dir}
                          --set checkpoint.dir=${CKPT} ${train_args}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${expected_exit}")
    message(FATAL_ERROR "${run_dir}: expected exit ${expected_exit}, got ${rc}\n${err}")
  endif()
  set(last_stderr "${err}" PARENT_SCOPE)
endfunction()

# losses_<run>: "step=loss" for every line of the run's metrics.jsonl.
function(read_losses run_dir out)
  file(STRINGS ${WORK}/${run_dir}/metrics.jsonl lines)
  set(result "")
  foreach(line IN LISTS lines)
    string(JSON step GET "${line}" step)
    string(REGEX MATCH "\"loss\":[^,}]*" loss "${line}")  # the text as written: all 17 digits
    list(APPEND result "${step}=${loss}")
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

function(expect_matches_reference run_dir)
  read_losses(reference reference)
  read_losses(${run_dir} resumed)
  list(LENGTH resumed n)
  if(n EQUAL 0)
    message(FATAL_ERROR "${run_dir} trained no steps")
  endif()
  foreach(entry IN LISTS resumed)
    list(FIND reference "${entry}" found)
    if(found EQUAL -1)
      message(FATAL_ERROR "${run_dir}: ${entry} differs from the uninterrupted run:\n${reference}")
    endif()
  endforeach()
endfunction()

function(expect_exists path)
  if(NOT EXISTS ${path})
    message(FATAL_ERROR "expected ${path} to exist")
  endif()
endfunction()

# The reference, in its own checkpoint directory.
execute_process(COMMAND ${MOETRAIN} train --config ${CONFIG} --set logging.run_dir=${WORK}/reference
                        --set checkpoint.dir=${WORK}/reference_checkpoints RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "reference run failed with ${rc}")
endif()

if(SCENARIO MATCHES "^fault_(.*)$")
  # Saves at steps 3, 6, 9 (checkpoint.every 3); the second save (step 6) is killed.
  set(phase ${CMAKE_MATCH_1})
  if(phase STREQUAL "during_cleanup")
    # The first deletion (step_3, at the step-9 save) dies half way: step_6 and step_9 survive.
    train(crashed "Subprocess killed" env MOETRAIN_FAULT=kill:rank=0:phase=${phase}:hit=1)
    expect_exists(${CKPT}/step_9/manifest.json)
    expect_exists(${CKPT}/step_6/manifest.json)
  else()
    # Saves at steps 3, 6, 9 (checkpoint.every 3); the second save (step 6) is killed.
    train(crashed "Subprocess killed" env MOETRAIN_FAULT=kill:rank=0:phase=${phase}:hit=2)
    expect_exists(${CKPT}/step_3/manifest.json)
  endif()
  train(resumed 0)
  expect_matches_reference(resumed)
  file(GLOB leftovers ${CKPT}/*.tmp ${CKPT}/*.deleting)
  if(leftovers)
    message(FATAL_ERROR "incomplete checkpoints not cleaned up: ${leftovers}")
  endif()
elseif(SCENARIO MATCHES "^signal_(term|int|hup)$")
  # SIGTERM (the scheduler), SIGINT (Ctrl-C) or SIGHUP (the terminal closed) after a few steps
  # (the run takes about a second: poll for the first metrics line).
  string(TOUPPER ${CMAKE_MATCH_1} signal)
  execute_process(COMMAND bash -c "\"$0\" train --config \"$1\" --set logging.run_dir=\"$2\" --set checkpoint.dir=\"$3\" \
--set checkpoint.every=0 --set train.steps=100000 & pid=$!; \
while [ ! -s \"$2/metrics.jsonl\" ]; do sleep 0.05; done; kill -$4 $pid; wait $pid"
                          ${MOETRAIN} ${CONFIG} ${WORK}/signalled ${CKPT} ${signal}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 75 OR NOT err MATCHES "stopped by SIG${signal} after step [0-9]+: checkpoint [^\n]* is committed")
    message(FATAL_ERROR "SIG${signal}: expected exit 75 and a committed checkpoint, got ${rc}\n${err}")
  endif()
  file(GLOB committed ${CKPT}/step_*/manifest.json)
  if(NOT committed)
    message(FATAL_ERROR "SIG${signal} left no committed checkpoint")
  endif()
elseif(SCENARIO MATCHES "^corrupt_(.*)$")
  set(kind ${CMAKE_MATCH_1})
  train(first 0 env)  # commits step_9 and step_10
  set(victim ${CKPT}/step_10/rank_00000.safetensors)
  if(kind STREQUAL "flip")
    # Overwrite byte 200 (inside the header's tensor table) with another value, using only
    # what every POSIX system has (sh, printf, dd), and check that the byte really changed.
    file(READ ${victim} old_byte OFFSET 200 LIMIT 1 HEX)
    if(old_byte STREQUAL "ff")
      set(new_octal "000")
      set(new_byte "00")
    else()
      set(new_octal "377")
      set(new_byte "ff")
    endif()
    execute_process(COMMAND sh -c "printf '\\${new_octal}' | dd of='${victim}' bs=1 seek=200 count=1 conv=notrunc"
                    RESULT_VARIABLE rc ERROR_VARIABLE dd_err)
    file(READ ${victim} flipped_byte OFFSET 200 LIMIT 1 HEX)
    if(NOT rc EQUAL 0 OR NOT flipped_byte STREQUAL new_byte)
      message(FATAL_ERROR "corrupt_flip: could not change byte 200 of ${victim} (${old_byte} -> ${flipped_byte}, "
                          "dd exit ${rc}: ${dd_err})")
    endif()
    set(expected "rank_00000.safetensors has crc32")
  elseif(kind STREQUAL "truncate")
    execute_process(COMMAND truncate -s 1000 ${victim} RESULT_VARIABLE rc)
    file(SIZE ${victim} truncated_size)
    if(NOT rc EQUAL 0 OR NOT truncated_size EQUAL 1000)
      message(FATAL_ERROR "corrupt_truncate: ${victim} is ${truncated_size} bytes after truncate (exit ${rc})")
    endif()
    set(expected "rank_00000.safetensors has 1000 bytes")
  elseif(kind STREQUAL "missing")
    file(REMOVE ${victim})
    if(EXISTS ${victim})
      message(FATAL_ERROR "corrupt_missing: could not remove ${victim}")
    endif()
    set(expected "rank_00000.safetensors is missing")
  else()
    file(WRITE ${CKPT}/step_10/manifest.json "{\"format\": \"moetrain-checkpoint\", \"files\": [{\"path\": \"../x\"}]}")
    set(expected "manifest.json")
  endif()
  # Asked for by path, the damaged checkpoint is exit 4 naming the damage, and nothing changes.
  file(GLOB_RECURSE before ${CKPT}/*)
  set(train_args --resume ${CKPT}/step_10)
  train(by_path 4 env)
  set(train_args "")
  if(NOT last_stderr MATCHES "${expected}")
    message(FATAL_ERROR "the error does not name the damage (${expected}):\n${last_stderr}")
  endif()
  file(GLOB_RECURSE after ${CKPT}/*)
  if(NOT before STREQUAL after)
    message(FATAL_ERROR "a failed resume changed the checkpoint directory")
  endif()
  # --resume auto says what is wrong with it, sets it aside (step_10.unusable) and resumes the
  # one before: the run ends as the uninterrupted one did.
  train(second 0 env)
  if(NOT last_stderr MATCHES "step_10 cannot be resumed \\([^\n]*${expected}"
     OR NOT last_stderr MATCHES "resuming from [^\n]*step_9, the newest intact checkpoint")
    message(FATAL_ERROR "--resume auto does not say that it passed over the damaged checkpoint:\n${last_stderr}")
  endif()
  expect_exists(${CKPT}/step_10.unusable)
  expect_exists(${CKPT}/step_10/manifest.json)
  expect_matches_reference(second)
elseif(SCENARIO STREQUAL "export_cli")
  execute_process(COMMAND ${MOETRAIN} export --checkpoint ${WORK}/reference_checkpoints --out ${WORK}/exported
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "export failed (${rc}): ${err}")
  endif()
  file(READ ${WORK}/exported/adapter_config.json config)
  string(JSON peft_type GET "${config}" peft_type)
  string(JSON r GET "${config}" r)
  if(NOT peft_type STREQUAL "LORA" OR NOT r EQUAL 4)
    message(FATAL_ERROR "adapter_config.json: ${config}")
  endif()
  # The end-of-training export and the export from the final checkpoint are the same bytes.
  file(SHA256 ${WORK}/exported/adapter_model.safetensors a)
  file(SHA256 ${WORK}/reference/adapter/adapter_model.safetensors b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "moetrain export and the end-of-training adapter differ")
  endif()
  execute_process(COMMAND ${MOETRAIN} export --checkpoint ${WORK}/nothing --out ${WORK}/x RESULT_VARIABLE rc
                  OUTPUT_QUIET ERROR_QUIET)
  if(NOT rc EQUAL 4)
    message(FATAL_ERROR "export of a missing checkpoint: expected exit 4, got ${rc}")
  endif()
endif()
