# The CUDA backend where there may be no GPU (ctest -P script):
#   without a GPU  a CUDA test exits 77 (ctest: Skipped) saying why, MNEMO_REQUIRE_GPU=1 makes that a
#                  failure that says so; train --device cuda fails with one line naming the flag and
#                  CUDA's reason
#   with a GPU     train --device cuda trains a few steps, and a checkpoint it writes resumes on the CPU
# Arguments: -DTEST=<a CUDA test binary> -DTRAIN=<train> -DWORK_DIR=<dir>
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(small --model compressive --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 64 --seq-len 8 --mem-len 8 --c-mem-len 8
    --batch 4 --eval-every 0 --eval-segments 2 --sample-len 0 --log-every 1000 --threads 1)

# Whether there is a GPU: the test binary's first line (its own tests are its own ctest entry, so
# doctest runs none of them here).
execute_process(COMMAND ${CMAKE_COMMAND} -E env MNEMO_REQUIRE_GPU=1 ${TEST} --no-run
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(err MATCHES ": on .*\\(sm_[0-9]+")
  string(STRIP "${err}" err)
  message(STATUS "no_gpu: a GPU is present (${err}); training on it")
  execute_process(COMMAND ${TRAIN} ${small} --device cuda --steps 4 --checkpoint ${WORK_DIR}/gpu.safetensors
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "device: ")
    message(FATAL_ERROR "no_gpu: train --device cuda failed (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND ${TRAIN} --resume ${WORK_DIR}/gpu.safetensors --device cpu --steps 6 --sample-len 0
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "no_gpu: resuming the GPU's checkpoint on the CPU failed (${rc}):\n${out}\n${err}")
  endif()
  return()
endif()
if(NOT rc EQUAL 1 OR NOT err MATCHES "FAILED \\(MNEMO_REQUIRE_GPU is set\\): ")
  message(FATAL_ERROR "no_gpu: with MNEMO_REQUIRE_GPU=1 and no GPU, ${TEST} should fail saying so (exit ${rc}):\n${err}")
endif()
execute_process(COMMAND ${TEST} --no-run RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 77 OR NOT err MATCHES "skipped: ")
  message(FATAL_ERROR "no_gpu: without a GPU, ${TEST} should exit 77 saying why (exit ${rc}):\n${err}")
endif()
execute_process(COMMAND ${TRAIN} ${small} --device cuda --steps 4
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "--device cuda: ")
  message(FATAL_ERROR "no_gpu: train --device cuda without a GPU should fail naming the flag (exit ${rc}):\n${out}\n${err}")
endif()
string(STRIP "${err}" err)
message(STATUS "no_gpu: as expected without a GPU: ${err}")
