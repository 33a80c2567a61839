# ctest driver for the model variants of examples/train (--residual, --norm, --memory-layers,
# --compression dilated|most-used, --reconstruction): a short run on a small text written here must
# lower the validation loss.
#   cmake -DTRAIN=<train> -DWORK_DIR=<scratch> -DOPTIONS="--residual;gru" -P train_variants.cmake
# With -DRESUME=ON instead: all the variants together must resume bit for bit (k steps, save, resume,
# k steps = 2k steps), and with -DEVAL=<mnemo_eval> -DTOKENS=<tokens file> mnemo_eval must read the
# variants from the checkpoint's metadata (the same output as with every variant given as a flag, and
# an error for a flag that disagrees with the metadata).
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

function(run out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_variants: `${ARGN}` failed (${rc}):\n${out}\n${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

set(DRIVER train_variants)
include(${CMAKE_CURRENT_LIST_DIR}/train_driver.cmake)

# About 4 KB of text with structure to learn: 80 lines from a few words.
write_structured_text(${WORK_DIR}/text.txt)

set(model --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 64 --seq-len 8 --mem-len 8 --c-mem-len 8
    --batch 8 --optimizer adamw --schedule constant --lr 3e-3 --warmup 5 --threads 1)

if(NOT RESUME)
  run(out ${TRAIN} --data ${WORK_DIR}/text.txt ${model} ${OPTIONS} --steps 60 --eval-every 10 --eval-segments 4
      --sample-len 0 --log-every 1000)
  string(REGEX MATCHALL "valid  step +[0-9]+: loss [0-9.]+" lines "${out}")
  list(LENGTH lines n)
  if(n LESS 2)
    message(FATAL_ERROR "train_variants: expected validation lines in:\n${out}")
  endif()
  list(GET lines 0 first)
  list(GET lines -1 last)
  string(REGEX REPLACE ".*loss " "" first "${first}")
  string(REGEX REPLACE ".*loss " "" last "${last}")
  message(STATUS "train_variants ${OPTIONS}: validation loss ${first} -> ${last} bits/char")
  if(NOT last LESS first)
    message(FATAL_ERROR "train_variants ${OPTIONS}: the validation loss did not fall (${first} -> ${last}):\n${out}")
  endif()
  return()
endif()

# All the variants together (most-used compression: the state file also carries the memory's usage).
set(variants --residual gru --norm post --memory-layers 1 --compression most-used --reconstruction autoencoding)
set(quiet --eval-every 0 --sample-len 0 --log-every 1000)
run(out ${TRAIN} --data ${WORK_DIR}/text.txt ${model} ${variants} ${quiet} --steps 40
    --checkpoint ${WORK_DIR}/full.safetensors)
run(out ${TRAIN} --data ${WORK_DIR}/text.txt ${model} ${variants} ${quiet} --steps 20
    --checkpoint ${WORK_DIR}/half.safetensors)
run(out ${TRAIN} --resume ${WORK_DIR}/half.safetensors ${quiet} --steps 40
    --checkpoint ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/full.safetensors ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/full.safetensors.state.safetensors ${WORK_DIR}/resumed.safetensors.state.safetensors)
# A flag that disagrees with the checkpoint's variant is refused on resume.
execute_process(COMMAND ${TRAIN} --resume ${WORK_DIR}/half.safetensors ${quiet} --norm pre --steps 40
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "checkpoint has norm post but --norm is pre")
  message(FATAL_ERROR "train_variants: resuming with --norm pre should fail (exit ${rc}):\n${out}\n${err}")
endif()

if(EVAL)
  set(eval_common --model compressive --checkpoint ${WORK_DIR}/full.safetensors --tokens ${TOKENS}
      --seq-len 4 --mem-len 4 --c-mem-len 3)
  run(out ${EVAL} ${eval_common} --out ${WORK_DIR}/eval_meta.safetensors)
  run(out ${EVAL} ${eval_common} --out ${WORK_DIR}/eval_flags.safetensors --residual gru --norm post
      --memory-layers 1 --compression most-used --reconstruction autoencoding)
  same(${WORK_DIR}/eval_meta.safetensors ${WORK_DIR}/eval_flags.safetensors)
  execute_process(COMMAND ${EVAL} ${eval_common} --out ${WORK_DIR}/eval_bad.safetensors --norm pre
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "--norm pre disagrees with the checkpoint's __metadata__ norm post")
    message(FATAL_ERROR "train_variants: mnemo_eval --norm pre should fail (exit ${rc}):\n${out}\n${err}")
  endif()
endif()
