# ctest driver for train's command line (examples/cli.hpp) and its metrics (mnemo/trainer/metrics.hpp):
#   1. --save-config writes the resolved settings; `train --config FILE` in another directory replays
#      the run: the same checkpoint, byte for byte.
#   2. --metrics writes one JSON line per progress line and per validation, with every key; resuming
#      from an earlier checkpoint drops the lines after it and appends, so no step appears twice.
#   3. tools/plot.sh draws the metrics into a PNG (when gnuplot is installed).
#   cmake -DTRAIN=<train> -DPLOT=<tools/plot.sh> -DWORK_DIR=<scratch directory> -P train_cli.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/a ${WORK_DIR}/b)

function(run dir)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY ${dir} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_cli: `${ARGN}` failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(DRIVER train_cli)
include(${CMAKE_CURRENT_LIST_DIR}/train_driver.cmake)

# The steps and kinds of a metrics file, in order: "train:10 train:20 valid:20 ...".
function(metric_steps file out)
  file(STRINGS ${file} lines)
  set(seq "")
  foreach(line IN LISTS lines)
    string(REGEX MATCH "\"kind\":\"([a-z]+)\",\"step\":([0-9]+)" m "${line}")
    if(NOT m)
      message(FATAL_ERROR "train_cli: ${file}: a line without kind and step: ${line}")
    endif()
    list(APPEND seq "${CMAKE_MATCH_1}:${CMAKE_MATCH_2}")
  endforeach()
  set(${out} "${seq}" PARENT_SCOPE)
endfunction()

set(text "")
foreach(i RANGE 1 10)
  string(APPEND text "line ${i}: the quick brown fox jumps over a lazy dog.\n")
endforeach()
file(WRITE ${WORK_DIR}/a/tiny.txt "${text}")
file(WRITE ${WORK_DIR}/b/tiny.txt "${text}")
set(model --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 64 --seq-len 4 --mem-len 4 --c-mem-len 6
    --batch 4 --warmup 10 --threads 2)

# 1. Save the settings, replay them elsewhere.
run(${WORK_DIR}/a ${TRAIN} --data tiny.txt ${model} --steps 12 --stop-at 6 --log-every 2 --eval-every 4
    --eval-segments 3 --sample-len 8 --top-k 3 --top-p 0.9 --checkpoint ck6.safetensors --metrics m.jsonl
    --save-config run.toml)
file(READ ${WORK_DIR}/a/run.toml config)
foreach(expected "data = \"tiny.txt\"" "d-model = 16" "top-k = 3" "top-p = 0.9" "stop-at = 6" "metrics = \"m.jsonl\"")
  string(FIND "${config}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "train_cli: run.toml lacks '${expected}':\n${config}")
  endif()
endforeach()
file(COPY ${WORK_DIR}/a/run.toml DESTINATION ${WORK_DIR}/b)
run(${WORK_DIR}/b ${TRAIN} --config run.toml)
same(${WORK_DIR}/a/ck6.safetensors ${WORK_DIR}/b/ck6.safetensors)
same(${WORK_DIR}/a/ck6.safetensors.state.safetensors ${WORK_DIR}/b/ck6.safetensors.state.safetensors)
# A flag on the command line wins over the file.
run(${WORK_DIR}/b ${TRAIN} --config run.toml --stop-at 4 --checkpoint ck4.safetensors)
if(NOT last_output MATCHES "saved ck4.safetensors[^\n]*step 4\\)")
  message(FATAL_ERROR "train_cli: --stop-at 4 on top of --config did not stop at step 4:\n${last_output}")
endif()

# 2. The metrics: every key, and the steps of the 6-step session.
file(STRINGS ${WORK_DIR}/a/m.jsonl lines)
list(GET lines 0 first)
foreach(key run kind step tokens loss bits_per_char ar lr grad_norm tokens_per_s elapsed_s)
  if(NOT first MATCHES "\"${key}\":")
    message(FATAL_ERROR "train_cli: the first metrics line lacks \"${key}\": ${first}")
  endif()
endforeach()
if(NOT first MATCHES "^\\{\"run\":\"compressive\",\"kind\":\"train\",\"step\":2,\"tokens\":32,")
  message(FATAL_ERROR "train_cli: unexpected first metrics line: ${first}")
endif()
metric_steps(${WORK_DIR}/a/m.jsonl seq)
if(NOT seq STREQUAL "train:2;train:4;valid:4;train:6;valid:6")
  message(FATAL_ERROR "train_cli: metrics of steps 1-6: ${seq}")
endif()
# Save a copy of the step-6 checkpoint, go on to step 12, then resume the copy: the lines after step 6
# are dropped, not duplicated.
file(COPY ${WORK_DIR}/a/ck6.safetensors ${WORK_DIR}/a/ck6.safetensors.state.safetensors DESTINATION ${WORK_DIR}/a/copy)
run(${WORK_DIR}/a ${TRAIN} --resume ck6.safetensors --log-every 2 --eval-every 4 --eval-segments 3 --sample-len 0
    --metrics m.jsonl)
metric_steps(${WORK_DIR}/a/m.jsonl seq)
set(expected "train:2;train:4;valid:4;train:6;valid:6;train:8;valid:8;train:10;train:12;valid:12")
if(NOT seq STREQUAL expected)
  message(FATAL_ERROR "train_cli: metrics after resuming to step 12: ${seq}\n  expected ${expected}")
endif()
run(${WORK_DIR}/a ${TRAIN} --resume copy/ck6.safetensors --log-every 2 --eval-every 4 --eval-segments 3
    --sample-len 0 --metrics m.jsonl)
metric_steps(${WORK_DIR}/a/m.jsonl seq)
if(NOT seq STREQUAL expected)
  message(FATAL_ERROR "train_cli: metrics after resuming step 6 again: ${seq}\n  expected ${expected}")
endif()

# 3. The plot.
find_program(GNUPLOT gnuplot)
if(GNUPLOT)
  run(${WORK_DIR}/a bash ${PLOT} --out curves.png --dumb m.jsonl)
  if(NOT last_output MATCHES "step")
    message(FATAL_ERROR "train_cli: plot.sh --dumb drew nothing in the terminal:\n${last_output}")
  endif()
  file(READ ${WORK_DIR}/a/curves.png head LIMIT 8 HEX)
  if(NOT head STREQUAL "89504e470d0a1a0a")
    message(FATAL_ERROR "train_cli: plot.sh did not write a PNG (first bytes ${head})")
  endif()
else()
  message(STATUS "train_cli: gnuplot not installed; tools/plot.sh not tried")
endif()
message(STATUS "train_cli: config replay, metrics and plot checked")
