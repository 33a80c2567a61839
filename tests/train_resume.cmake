# ctest driver for examples/train: training k steps, saving, resuming and training k more steps must
# give the same checkpoint, byte for byte, as 2k uninterrupted steps (model file and trainer state),
# across passes over the data (the streams wrap, and the memory is emptied, twice in 80 steps), and
# on the recall task with validations and samples in between; the same for the Feedback Transformer
# (no memory; its samples run the generator).
# Then a few bad inputs must fail with their message.
#   cmake -DTRAIN=<train executable> -DWORK_DIR=<scratch directory> -P train_resume.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_resume: `${ARGN}` failed (${rc}):\n${out}\n${err}")
  endif()
endfunction()

# `run_fails(regex command...)`: the command must exit non-zero with `regex` in its error output.
function(run_fails regex)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "${regex}")
    message(FATAL_ERROR "train_resume: `${ARGN}` should fail with '${regex}' (exit ${rc}):\n${out}\n${err}")
  endif()
endfunction()

set(DRIVER train_resume)
include(${CMAKE_CURRENT_LIST_DIR}/train_driver.cmake)

# A tiny text: about 550 bytes, so 90% in 4 streams is 30 segments of 4 per pass.
set(text "")
foreach(i RANGE 1 10)
  string(APPEND text "line ${i}: the quick brown fox jumps over a lazy dog.\n")
endforeach()
file(WRITE ${WORK_DIR}/tiny.txt "${text}")

set(model --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 64 --seq-len 4 --mem-len 4
    --c-mem-len 6 --batch 4 --warmup 10)
set(quiet --eval-every 0 --sample-len 0 --log-every 1000)
run(${TRAIN} --data ${WORK_DIR}/tiny.txt ${model} ${quiet} --threads 2 --steps 80 --checkpoint ${WORK_DIR}/full.safetensors)
run(${TRAIN} --data ${WORK_DIR}/tiny.txt ${model} ${quiet} --threads 2 --steps 40 --checkpoint ${WORK_DIR}/half.safetensors)
# Resumed on one thread: results do not depend on the thread count.
run(${TRAIN} --resume ${WORK_DIR}/half.safetensors ${quiet} --threads 1 --steps 80 --checkpoint ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/full.safetensors ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/full.safetensors.state.safetensors ${WORK_DIR}/resumed.safetensors.state.safetensors)

# The recall task with its cosine schedule (which spans --steps, so the first half stops with --stop-at),
# validations and samples between steps (the sampling RNG is part of the state).
set(recall --task recall --model compressive --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 1 --c-mem-len 8
    --batch 4 --steps 60)
set(busy --threads 2 --eval-every 10 --eval-segments 4 --eval-sample 5 --sample-len 5 --log-every 1000)
run(${TRAIN} ${recall} ${busy} --checkpoint ${WORK_DIR}/recall_full.safetensors)
run(${TRAIN} ${recall} ${busy} --stop-at 30 --checkpoint ${WORK_DIR}/recall_half.safetensors)
run(${TRAIN} --resume ${WORK_DIR}/recall_half.safetensors ${busy} --checkpoint ${WORK_DIR}/recall_resumed.safetensors)
same(${WORK_DIR}/recall_full.safetensors ${WORK_DIR}/recall_resumed.safetensors)
same(${WORK_DIR}/recall_full.safetensors.state.safetensors ${WORK_DIR}/recall_resumed.safetensors.state.safetensors)

# The Feedback Transformer, shared keys/values (its default optimiser, Noam), on the text: every segment
# from an empty memory; 40 steps of 4 streams × 8 tokens wrap the streams twice (15 segments a pass).
set(feedback --model feedback-kv --d-model 16 --heads 2 --d-ff 32 --layers 2 --n-pos 16 --seq-len 8 --batch 4
    --warmup 10)
run(${TRAIN} --data ${WORK_DIR}/tiny.txt ${feedback} ${quiet} --threads 2 --steps 40 --checkpoint ${WORK_DIR}/fb_full.safetensors)
run(${TRAIN} --data ${WORK_DIR}/tiny.txt ${feedback} ${quiet} --threads 2 --steps 20 --checkpoint ${WORK_DIR}/fb_half.safetensors)
run(${TRAIN} --resume ${WORK_DIR}/fb_half.safetensors ${quiet} --threads 1 --steps 40 --checkpoint ${WORK_DIR}/fb_resumed.safetensors)
same(${WORK_DIR}/fb_full.safetensors ${WORK_DIR}/fb_resumed.safetensors)
same(${WORK_DIR}/fb_full.safetensors.state.safetensors ${WORK_DIR}/fb_resumed.safetensors.state.safetensors)

# The original Feedback Transformer on the recall task, with validations and samples in between (the
# recall prompt is longer than n_pos + 1 = 17 tokens, so sampling also restarts the generator).
set(recall_fb --task recall --model feedback --d-model 16 --heads 2 --d-ff 32 --layers 1 --n-pos 16 --seq-len 8
    --batch 4 --steps 30)
run(${TRAIN} ${recall_fb} ${busy} --checkpoint ${WORK_DIR}/recall_fb_full.safetensors)
run(${TRAIN} ${recall_fb} ${busy} --stop-at 15 --checkpoint ${WORK_DIR}/recall_fb_half.safetensors)
run(${TRAIN} --resume ${WORK_DIR}/recall_fb_half.safetensors ${busy} --checkpoint ${WORK_DIR}/recall_fb_resumed.safetensors)
same(${WORK_DIR}/recall_fb_full.safetensors ${WORK_DIR}/recall_fb_resumed.safetensors)
same(${WORK_DIR}/recall_fb_full.safetensors.state.safetensors
     ${WORK_DIR}/recall_fb_resumed.safetensors.state.safetensors)

run_fails("checkpoint has d_model 16 but --d-model is 64"
          ${TRAIN} --resume ${WORK_DIR}/half.safetensors ${quiet} --d-model 64)
run_fails("unknown option '--bogus'" ${TRAIN} --bogus 1)
run_fails("--batch expects an integer, got 'x'" ${TRAIN} --batch x)
run_fails("d_model 24 does not split into 5 heads" ${TRAIN} --d-model 24 --heads 5 --steps 1)
file(WRITE ${WORK_DIR}/empty.txt "")
run_fails("is empty" ${TRAIN} --data ${WORK_DIR}/empty.txt)
run_fails("the text is too short" ${TRAIN} --data ${WORK_DIR}/tiny.txt --batch 64)
run_fails("--model feedback carries no memory between segments .*--mem-len must be 0 or left out, got 4"
          ${TRAIN} --data ${WORK_DIR}/tiny.txt --model feedback --mem-len 4)
run_fails("--model feedback-kv has no compression and none of the compressive model.s variants: --rate does not apply" ${TRAIN} --model feedback-kv --rate 2)
run_fails("--n-pos 6 is too small: the last token of a sequence of --seq-len 8 attends over 7"
          ${TRAIN} --data ${WORK_DIR}/tiny.txt --model feedback-kv --d-model 16 --heads 2 --seq-len 8 --n-pos 6)
run_fails("checkpoint has model feedback-kv but --model is compressive"
          ${TRAIN} --resume ${WORK_DIR}/fb_half.safetensors ${quiet} --model compressive)
run_fails("d_model 24 does not split into 5 heads" ${TRAIN} --model feedback --d-model 24 --heads 5 --steps 1)
message(STATUS "train_resume: resumed runs identical to the uninterrupted ones")
