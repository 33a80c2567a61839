# ctest driver for `mpirun -np N train`: data-parallel runs of the program (the library's part is
# tests/test_data_parallel.cpp).
#   cmake -DTRAIN=<train> -DMPIEXEC=<mpiexec> -DWORK_DIR=<scratch> -P train_mpi.cmake
# Checks:
#   - 2 ranks train like one process (the final validation loss within 1e-4 bits/char), print once,
#     report the exchanged bytes, and their checkpoint resumes bit for bit on 2 ranks (the files equal
#     an uninterrupted run's), and resumes in one process and on 4 ranks;
#   - the Feedback Transformer trains on 2 ranks like one process;
#   - errors end every rank with one message, without hanging (ctest's TIMEOUT would catch a hang): a
#     data file that one rank cannot read, settings that differ between ranks, a --batch that the rank
#     count does not divide, a save that fails on rank 0.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(DRIVER train_mpi)
include(${CMAKE_CURRENT_LIST_DIR}/train_driver.cmake)
set(mpi ${MPIEXEC} --oversubscribe --bind-to none)

# `run(out_var command...)`: must succeed; its output goes to out_var.
function(run out_var)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_mpi: `${ARGN}` failed (${rc}):\n${out}\n${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# `run_fails(regex command...)`: must exit non-zero with `regex` exactly once in its error output.
function(run_fails regex)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX MATCHALL "${regex}" found "${err}")
  list(LENGTH found count)
  if(rc EQUAL 0 OR NOT count EQUAL 1)
    message(FATAL_ERROR "train_mpi: `${ARGN}` should fail with '${regex}' once (exit ${rc}, found ${count}):\n${out}\n${err}")
  endif()
endfunction()

# The final validation loss of a run's output.
function(final_loss out_var text)
  string(REGEX MATCHALL "valid  step +[0-9]+: loss [0-9.]+" lines "${text}")
  list(GET lines -1 last)
  string(REGEX REPLACE ".*loss " "" value "${last}")
  set(${out_var} ${value} PARENT_SCOPE)
endfunction()

# `expect_close(what a b)`: two losses printed with 4 decimals may differ by one in the last (cmake has no
# floating-point arithmetic: compare them as integers of 1e-4 bits/char).
function(expect_close what a b)
  string(REPLACE "." "" ai "${a}")
  string(REPLACE "." "" bi "${b}")
  math(EXPR d "${ai} - ${bi}")
  if(d GREATER 1 OR d LESS -1)
    message(FATAL_ERROR "train_mpi: ${what}: ${a} against ${b} bits/char")
  endif()
endfunction()

write_structured_text(${WORK_DIR}/text.txt)
set(shape --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 32 --seq-len 4
    --mem-len 4 --c-mem-len 4 --batch 4 --warmup 4 --compression most-used --eval-every 0 --log-every 10
    --sample-len 0 --threads 1)
set(model --data ${WORK_DIR}/text.txt ${shape})

# One process against 2 ranks.
run(one ${TRAIN} ${model} --steps 20)
run(two ${mpi} -np 2 ${TRAIN} ${model} --steps 20 --checkpoint ${WORK_DIR}/two20.safetensors)
final_loss(l1 "${one}")
final_loss(l2 "${two}")
expect_close("2 ranks against one process" ${l1} ${l2})
foreach(expected "processes: MPI, 2 ranks, 2 streams each" "exchange [0-9.]+ MB/step in [0-9.]+ ms")
  if(NOT two MATCHES "${expected}")
    message(FATAL_ERROR "train_mpi: no '${expected}' in the 2-rank output:\n${two}")
  endif()
endforeach()
string(REGEX MATCHALL "\ntrain: training one model" headers "\n${two}")
list(LENGTH headers n_headers)
if(NOT n_headers EQUAL 1)
  message(FATAL_ERROR "train_mpi: the 2-rank run printed its header ${n_headers} times:\n${two}")
endif()

# 10 + 10 steps on 2 ranks equal 20 steps on 2 ranks, byte for byte.
run(half ${mpi} -np 2 ${TRAIN} ${model} --steps 20 --stop-at 10 --checkpoint ${WORK_DIR}/two10.safetensors)
run(rest ${mpi} -np 2 ${TRAIN} --resume ${WORK_DIR}/two10.safetensors --threads 1 --sample-len 0
    --checkpoint ${WORK_DIR}/resumed.safetensors)
same(${WORK_DIR}/resumed.safetensors ${WORK_DIR}/two20.safetensors)
same(${WORK_DIR}/resumed.safetensors.state.safetensors ${WORK_DIR}/two20.safetensors.state.safetensors)

# The 2-rank checkpoint continues in one process and on 4 ranks.
file(COPY_FILE ${WORK_DIR}/two20.safetensors ${WORK_DIR}/for_one.safetensors)
file(COPY_FILE ${WORK_DIR}/two20.safetensors.state.safetensors ${WORK_DIR}/for_one.safetensors.state.safetensors)
run(more ${TRAIN} --resume ${WORK_DIR}/for_one.safetensors --steps 30 --threads 1 --sample-len 0)
run(more4 ${mpi} -np 4 ${TRAIN} --resume ${WORK_DIR}/two20.safetensors --steps 30 --threads 1 --sample-len 0)
final_loss(m1 "${more}")
final_loss(m4 "${more4}")
expect_close("resumed in one process against on 4 ranks" ${m1} ${m4})

# The Feedback Transformer.
set(feedback --data ${WORK_DIR}/text.txt --model feedback --d-model 16 --heads 2 --d-ff 32 --layers 2 --n-pos 32
    --seq-len 8 --mem-len 0 --c-mem-len 0 --batch 4 --optimizer adamw --lr 3e-3 --warmup 4 --eval-every 0
    --log-every 10 --sample-len 0 --threads 1 --steps 10)
run(f1 ${TRAIN} ${feedback})
run(f2 ${mpi} -np 2 ${TRAIN} ${feedback})
final_loss(fl1 "${f1}")
final_loss(fl2 "${f2}")
expect_close("feedback, 2 ranks against one process" ${fl1} ${fl2})

# Errors: one message, every rank ends.
run_fails("rank 1: data file '[^']*missing\\.txt' does not exist"
          ${mpi} -np 1 ${TRAIN} ${model} --steps 5 : -np 1 ${TRAIN} ${shape} --data ${WORK_DIR}/missing.txt --steps 5)
run_fails("rank 1: train: the settings or the data differ from rank 0's \\('--lr 0\\.002' here, '--lr [0-9.e-]+' on rank 0\\)"
          ${mpi} -np 1 ${TRAIN} ${model} --steps 5 : -np 1 ${TRAIN} ${model} --lr 0.002 --steps 5)
run_fails("--batch 4 must be a multiple of the 3 ranks" ${mpi} -np 3 ${TRAIN} ${model} --steps 5)
run_fails("train: --checkpoint: cannot write"
          ${mpi} -np 2 ${TRAIN} ${model} --steps 5 --checkpoint ${WORK_DIR}/no/such/dir/x.safetensors)
# A save that fails on rank 0 after training started: a directory where the state file goes.
file(MAKE_DIRECTORY ${WORK_DIR}/x.safetensors.state.safetensors)
run_fails("rank 0: .*x\\.safetensors"
          ${mpi} -np 2 ${TRAIN} ${model} --steps 5 --save-every 2 --checkpoint ${WORK_DIR}/x.safetensors)
message(STATUS "train_mpi: passed (final losses: one process ${l1}, 2 ranks ${l2}; feedback ${fl1}, ${fl2})")
