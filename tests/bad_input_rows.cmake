# The bad inputs of `train` and `mnemo_eval`, one ctest each (bad_input.<name>): what a user may get
# wrong, and the one-line message each must give (a regular expression). tests/bad_inputs.cmake runs
# one row; examples/CMakeLists.txt registers them all. Files under ${W} are made by the setup row
# (see tests/bad_inputs.cmake). docs/reliability.md's table of bad inputs lists the messages these rows get.
#   bad_input(name "what was tried" "expected message (regex)" command...)

set(tiny_shape --d-model 16 --heads 2 --rate 2 --d-ff 32 --layers 2 --n-pos 64 --seq-len 4 --mem-len 4
    --c-mem-len 6 --warmup 10 --eval-every 0 --log-every 1000 --threads 2)
set(tiny_model ${tiny_shape} --batch 4 --sample-len 0)
set(eval_args --tokens ${GOLDEN}/compressive_tokens.safetensors --out ${W}/eval_out.safetensors
    --model compressive --seq-len 4 --mem-len 4 --c-mem-len 3)

# Checkpoints and state files.
bad_input(resume_missing "--resume of a file that does not exist"
  "--resume: checkpoint '[^']*nothing.safetensors' does not exist" ${TRAIN} --resume ${W}/nothing.safetensors)
bad_input(resume_model_only "--resume of a model-only file (from --export)"
  "a model-only file \\(from --export\\) cannot be resumed" ${TRAIN} --resume ${W}/export.safetensors)
bad_input(resume_truncated_model "--resume of a truncated model file"
  "'[^']*truncated/ck.safetensors': tensor '[^']*': data_offsets \\[[0-9]+, [0-9]+\\] are out of range of the data section, which has [0-9]+ bytes \\(is the file truncated\\?\\)" ${TRAIN} --resume ${W}/truncated/ck.safetensors)
bad_input(resume_truncated_state "--resume with a truncated state file"
  "ck.safetensors.state.safetensors': tensor '[^']*': data_offsets .* \\(is the file truncated\\?\\)" ${TRAIN} --resume ${W}/truncated_state/ck.safetensors)
bad_input(resume_corrupt_header "--resume of a model file whose header is corrupt"
  "'[^']*corrupt/ck.safetensors': (malformed JSON|the header is not a JSON object)" ${TRAIN} --resume ${W}/corrupt/ck.safetensors)
bad_input(resume_mixed_pair "--resume of a model and a state file from two runs (same step)"
  "the two files do not belong together" ${TRAIN} --resume ${W}/mixed/ck.safetensors)
bad_input(resume_other_shape "--resume with another model shape"
  "checkpoint has d_model 16 but --d-model is 64" ${TRAIN} --resume ${W}/ck.safetensors --d-model 64)
bad_input(resume_other_variant "--resume with another compression variant"
  "checkpoint has compression conv but --compression is max" ${TRAIN} --resume ${W}/ck.safetensors --compression max)
bad_input(resume_other_model "--resume as another model"
  "checkpoint has model compressive but --model is xl" ${TRAIN} --resume ${W}/ck.safetensors --model xl --c-mem-len 0)
bad_input(resume_other_data "--resume on another data file (so another vocabulary)"
  "the data differs from the data the checkpoint was trained on" ${TRAIN} --resume ${W}/ck.safetensors --data ${W}/other.txt)
bad_input(eval_truncated_checkpoint "mnemo_eval of a truncated checkpoint"
  "'[^']*truncated/ck.safetensors': tensor '[^']*': data_offsets .* \\(is the file truncated\\?\\)"
  ${EVAL} --checkpoint ${W}/truncated/ck.safetensors ${eval_args})
bad_input(eval_corrupt_checkpoint "mnemo_eval of a checkpoint whose header is corrupt"
  "(malformed JSON|the header is not a JSON object)" ${EVAL} --checkpoint ${W}/corrupt/ck.safetensors ${eval_args})
bad_input(eval_not_safetensors "mnemo_eval of a text file given as checkpoint"
  "'[^']*tiny.txt' (declares a header|is truncated)" ${EVAL} --checkpoint ${W}/tiny.txt ${eval_args})

# Data.
bad_input(data_missing "--data of a file that does not exist" "data file '[^']*nothing.txt' does not exist"
  ${TRAIN} --data ${W}/nothing.txt ${tiny_model})
bad_input(data_directory "--data of a directory" "data file '[^']*' is a directory" ${TRAIN} --data ${W} ${tiny_model})
bad_input(data_empty "an empty data file" "data file '[^']*empty.txt' is empty" ${TRAIN} --data ${W}/empty.txt ${tiny_model})
bad_input(data_binary "a binary data file" "data file '[^']*binary.bin' looks binary \\(a NUL byte at offset 3\\)"
  ${TRAIN} --data ${W}/binary.bin ${tiny_model})
bad_input(data_short "a data file shorter than one segment per stream" "the text is too short"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_shape} --sample-len 0 --batch 64)
bad_input(prompt_outside_vocabulary "a --prompt with a byte the data does not have"
  "--prompt has the byte 0x5a at offset 2, which is not in the model's vocabulary"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_shape} --batch 4 --steps 1 --sample-len 4 --prompt "liZ")

# Output paths.
bad_input(checkpoint_no_directory "--checkpoint in a directory that does not exist"
  "--checkpoint: cannot write '[^']*': the directory '[^']*no_such_dir' does not exist"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_model} --steps 1 --checkpoint ${W}/no_such_dir/ck.safetensors)
bad_input(checkpoint_is_directory "--checkpoint naming a directory" "--checkpoint: '[^']*' is a directory"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_model} --steps 1 --checkpoint ${W})
bad_input(export_no_directory "--export in a directory that does not exist"
  "--export: cannot write '[^']*': the directory '[^']*no_such_dir' does not exist"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_model} --steps 1 --export ${W}/no_such_dir/model.safetensors)

list(JOIN tiny_model " " tiny_model_words)
bad_input(checkpoint_disk_full "a save that hits a file-size limit (as on a full disk)"
  "cannot write '[^']*full/ck.safetensors.pending': write to '[^']*' failed: File too large"
  sh -c "ulimit -f 16 && exec '${TRAIN}' --data '${W}/tiny.txt' ${tiny_model_words} --steps 1 --checkpoint '${W}/full/ck.safetensors'")

# Flags.
bad_input(flag_unknown "an unknown flag" "unknown option '--bogus' \\(try --help\\)" ${TRAIN} --bogus 1)
bad_input(flag_no_value "a flag without its value" "option --steps needs a value" ${TRAIN} --steps)
bad_input(flag_twice "a flag given twice" "option --steps given twice" ${TRAIN} --steps 1 --steps 2)
bad_input(flag_unknown_choice "an unknown --optimizer" "unknown --optimizer 'sgdx'" ${TRAIN} --optimizer sgdx)
# Every numeric flag: malformed, below its range, and (sizes) above it.
foreach(flag --d-model --heads --rate --d-ff --layers --n-pos --seq-len --mem-len --c-mem-len --batch --clamp-len
             --seed --steps --warmup --eval-every --eval-segments --log-every --sample-len --eval-sample
             --save-every --stop-at --eval-mem-len --eval-c-mem-len --threads --top-k)
  string(REPLACE "-" "_" id ${flag})
  bad_input(int${id}_malformed "${flag} 12x" "${flag} expects an integer, got '12x'" ${TRAIN} ${flag} 12x)
  bad_input(int${id}_negative "${flag} -3" "${flag} must be at least -?[0-9]+, got -3" ${TRAIN} ${flag} -3)
  bad_input(int${id}_overflow "${flag} 99999999999999999999" "${flag} expects an integer, got '99999999999999999999'"
    ${TRAIN} ${flag} 99999999999999999999)
endforeach()
foreach(flag --d-ff --layers --n-pos --seq-len --mem-len --c-mem-len --batch --clamp-len --sample-len --eval-sample
             --eval-mem-len --eval-c-mem-len --threads --top-k)
  string(REPLACE "-" "_" id ${flag})
  bad_input(int${id}_too_large "${flag} 1000000000000" "${flag} must be at most [0-9]+, got 1000000000000"
    ${TRAIN} ${flag} 1000000000000)
endforeach()
foreach(flag --lr --weight-decay --clip --temperature --top-p)
  string(REPLACE "-" "_" id ${flag})
  bad_input(real${id}_malformed "${flag} 1e-3x" "${flag} expects a number, got '1e-3x'" ${TRAIN} ${flag} 1e-3x)
  bad_input(real${id}_nan "${flag} nan" "${flag} expects a number, got 'nan'" ${TRAIN} ${flag} nan)
  bad_input(real${id}_negative "${flag} -1" "${flag} must be (at least 0|>= 0), got -1" ${TRAIN} ${flag} -1)
endforeach()
bad_input(top_p_above_one "--top-p 1.5" "--top-p must be at most 1, got 1.5" ${TRAIN} --top-p 1.5)
bad_input(greedy_with_temperature "--greedy with --temperature"
  "--greedy samples by argmax: --temperature does not apply" ${TRAIN} --greedy --temperature 0.5)
bad_input(flag_positional "a word that is not a flag" "unexpected argument 'data.txt'" ${TRAIN} data.txt)
bad_input(config_missing "--config of a file that does not exist" "--config: [^ ]*nothing.toml was not readable"
  ${TRAIN} --config ${W}/nothing.toml)
bad_input(config_bad_value "a --config file with a malformed value" "--steps expects an integer, got 'many'"
  ${TRAIN} --config ${W}/bad.toml)
bad_input(metrics_no_directory "--metrics in a directory that does not exist"
  "--metrics: cannot write '[^']*': the directory '[^']*' does not exist"
  ${TRAIN} --metrics ${W}/no/such/dir/m.jsonl)
bad_input(int_zero_d_model "--d-model 0" "--d-model must be at least 1, got 0" ${TRAIN} --d-model 0)
bad_input(d_model_heads_indivisible "--d-model 24 --heads 5 (heads must divide d_model)"
  "d_model 24 does not split into 5 heads \\(d_model must be a multiple of heads\\)" ${TRAIN} --d-model 24 --heads 5
  --steps 1)
bad_input(eval_flag_malformed "mnemo_eval --mem-len four" "--mem-len expects an integer, got 'four'"
  ${EVAL} --checkpoint ${GOLDEN}/compressive_checkpoint.safetensors --tokens ${GOLDEN}/compressive_tokens.safetensors
  --out ${W}/eval_out.safetensors --model compressive --seq-len 4 --mem-len four --c-mem-len 3)
bad_input(eval_flag_negative "mnemo_eval --seq-len -2" "--seq-len must be at least 1, got -2"
  ${EVAL} --checkpoint ${GOLDEN}/compressive_checkpoint.safetensors --tokens ${GOLDEN}/compressive_tokens.safetensors
  --out ${W}/eval_out.safetensors --model compressive --seq-len -2 --mem-len 4 --c-mem-len 3)

# Numerical faults.
bad_input(nonfinite_loss "a learning rate that drives the loss to NaN"
  "step 2: the (loss|reconstruction loss|gradient norm) is -?nan; stopped before the optimizer step \\(the last checkpoint, '[^']*nan.safetensors' at step 1, is kept"
  ${TRAIN} --data ${W}/tiny.txt ${tiny_model} --steps 20 --lr 1e30 --clip 0 --save-every 1
  --checkpoint ${W}/nan.safetensors)
