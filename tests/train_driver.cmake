# What the ctest drivers of examples/train share (train_resume, train_variants, train_runtime_shape,
# train_cli). Each sets DRIVER to its name, for the messages, before including this file.

# `same(a b)`: the two files must be byte for byte the same.
function(same a b)
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${a} ${b} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${DRIVER}: ${a} and ${b} differ")
  endif()
endfunction()

# `write_structured_text(path)`: about 4 KB of text with structure to learn, 80 lines from a few words.
function(write_structured_text path)
  set(words the quick brown fox jumps over a lazy dog and runs far into the woods)
  set(text "")
  foreach(i RANGE 1 80)
    math(EXPR a "(${i} * 7) % 15")
    math(EXPR b "(${i} * 11 + 3) % 15")
    math(EXPR c "(${i} * 13 + 5) % 15")
    list(GET words ${a} wa)
    list(GET words ${b} wb)
    list(GET words ${c} wc)
    string(APPEND text "${wa} ${wb} ${wc}, the quick brown fox jumps over ${wc} lazy dog.\n")
  endforeach()
  file(WRITE ${path} "${text}")
endfunction()
