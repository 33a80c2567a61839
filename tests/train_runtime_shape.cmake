# ctest driver for shapes that are not compiled in (examples/model_zoo.hpp's runtime-shape fallback):
#   cmake -DTRAIN=<train> -DEVAL=<mnemo_eval> -DTOKENS=<tokens file> -DWORK_DIR=<scratch> -P train_runtime_shape.cmake
# - train --d-model 24 --heads 3 (compressive, feedback, and dilated compression at rate 4) says on
#   start-up that the shape runs the generic kernels, and the compressive run lowers the validation loss;
# - it resumes bit for bit (k steps, save, resume, k steps = 2k steps), and mnemo_eval reads the
#   checkpoint (the same note, then its segments);
# - a compiled-in shape prints no note, and with MNEMO_FORCE_DYNAMIC=1 it says it was forced.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

set(note "mnemo: note: d_model 24, heads 3")
set(generic "runs the generic kernels")
set(note_regex "${note}[^\n]*${generic}")

# Runs a command; out_var gets stdout and stderr together.
function(run out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_runtime_shape: `${ARGN}` failed (${rc}):\n${out}\n${err}")
  endif()
  set(${out_var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(expect text regex what)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "train_runtime_shape: ${what}: no match for '${regex}' in:\n${text}")
  endif()
endfunction()

set(DRIVER train_runtime_shape)
include(${CMAKE_CURRENT_LIST_DIR}/train_driver.cmake)

# About 4 KB of text with structure to learn (as train_variants.cmake).
write_structured_text(${WORK_DIR}/text.txt)

set(common --data ${WORK_DIR}/text.txt --d-ff 32 --layers 2 --n-pos 64 --seq-len 8 --mem-len 8 --c-mem-len 8
    --batch 8 --optimizer adamw --schedule constant --lr 3e-3 --warmup 5 --threads 1 --sample-len 0 --log-every 1000)
set(shape --d-model 24 --heads 3 --rate 2)
set(quiet --eval-every 0)

# Compressive at 24/3/2: the note, then a falling validation loss.
run(out ${TRAIN} ${common} ${shape} --steps 40 --eval-every 10 --eval-segments 4)
expect("${out}" "${note}, compression rate 2 \\(compressive, conv\\) ${generic}" "the start-up note")
expect("${out}" "compiled in: 128/4/2" "the compiled-in shapes in the note")
string(REGEX MATCHALL "valid  step +[0-9]+: loss [0-9.]+" lines "${out}")
list(GET lines 0 first)
list(GET lines -1 last)
string(REGEX REPLACE ".*loss " "" first "${first}")
string(REGEX REPLACE ".*loss " "" last "${last}")
message(STATUS "train_runtime_shape 24/3/2: validation loss ${first} -> ${last} bits/char")
if(NOT last LESS first)
  message(FATAL_ERROR "train_runtime_shape: the validation loss did not fall (${first} -> ${last}):\n${out}")
endif()

# Resume bit for bit, and mnemo_eval reads the checkpoint.
run(out ${TRAIN} ${common} ${shape} ${quiet} --steps 20 --checkpoint ${WORK_DIR}/full.safetensors)
run(out ${TRAIN} ${common} ${shape} ${quiet} --steps 10 --checkpoint ${WORK_DIR}/half.safetensors)
run(out ${TRAIN} --resume ${WORK_DIR}/half.safetensors ${quiet} --sample-len 0 --log-every 1000 --steps 20
    --checkpoint ${WORK_DIR}/resumed.safetensors)
expect("${out}" "${note_regex}" "the note on resume")
same(${WORK_DIR}/full.safetensors ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/full.safetensors.state.safetensors ${WORK_DIR}/resumed.safetensors.state.safetensors)
run(out ${EVAL} --model compressive --checkpoint ${WORK_DIR}/full.safetensors --tokens ${TOKENS} --seq-len 4
    --mem-len 4 --c-mem-len 3 --out ${WORK_DIR}/eval.safetensors)
expect("${out}" "${note_regex}" "mnemo_eval's note")
expect("${out}" "segment 0: ce [0-9]+\\.[0-9]+" "mnemo_eval's segments")

# The Feedback Transformer, and dilated compression (compiled in for fewer shapes), at 24/3.
run(out ${TRAIN} --data ${WORK_DIR}/text.txt --model feedback --d-model 24 --heads 3 --d-ff 32 --layers 2
    --n-pos 16 --seq-len 16 --batch 4 --optimizer adamw --lr 3e-3 --warmup 2 --threads 1 --sample-len 0 ${quiet}
    --steps 5)
expect("${out}" "${note} \\(feedback\\) ${generic}" "the feedback note")
run(out ${TRAIN} ${common} --d-model 24 --heads 3 --rate 4 --compression dilated ${quiet} --steps 5)
expect("${out}" "${note}, compression rate 4 \\(compressive, dilated\\) ${generic}" "the dilated note")

# A compiled-in shape: no note; forced with MNEMO_FORCE_DYNAMIC=1.
set(compiled --d-model 16 --heads 2 --rate 2)
run(out ${TRAIN} ${common} ${compiled} ${quiet} --steps 3)
if(out MATCHES "runs the generic kernels")
  message(FATAL_ERROR "train_runtime_shape: a compiled-in shape ran the generic kernels:\n${out}")
endif()
run(out ${CMAKE_COMMAND} -E env MNEMO_FORCE_DYNAMIC=1 ${TRAIN} ${common} ${compiled} ${quiet} --steps 3)
expect("${out}" "mnemo: note: d_model 16, heads 2, compression rate 2 \\(compressive, conv\\) runs the generic kernels[^\n]*MNEMO_FORCE_DYNAMIC is set"
       "the forced note")
