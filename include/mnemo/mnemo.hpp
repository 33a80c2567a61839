#pragma once
// mnemo: long-range sequence models with memory, header-only C++20 (CPU build).
// Include this one header, or the pieces you need:
//   core/     shapes, views, backend tags and memory, parameters, buffers, rng, errors
//   kernels/  the kernel table; cpu/ (Eigen GEMM, xsimd element-wise kernels, OpenMP threads)
//   nn/       layers with hand-written backward passes
//   losses/   cross-entropy, and the compressive models' reconstruction losses (attention, auto-encoding)
//   models/   compressive_transformer (and Transformer-XL as its c_mem_len = 0 case), its memory,
//             feedback_transformer (plain and shared-KV), the autoregressive wrapper
//   train/    optimizers, clipping, schedules, checkpoints, the text data reader
//   io/       safetensors reader and writer (and its JSON parser)
//   trainer/  the training loop: segment streams, trainer<Model>, checkpoints with trainer state, metrics
#include "core/activation.hpp"
#include "core/backend.hpp"
#include "core/buffer.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/parameters.hpp"
#include "core/rng.hpp"
#include "core/shape.hpp"
#include "core/view.hpp"
#include "kernels/cpu/ops.hpp"
#include "nn/attention/feedback.hpp"
#include "nn/attention/relative.hpp"
#include "nn/compression.hpp"
#include "nn/embedding.hpp"
#include "nn/feed_forward.hpp"
#include "nn/gru_gate.hpp"
#include "nn/layer_norm.hpp"
#include "nn/linear.hpp"
#include "nn/residual.hpp"
#include "models/autoregressive.hpp"
#include "models/compressive_transformer.hpp"
#include "models/feedback_transformer.hpp"
#include "losses/attention_reconstruction.hpp"
#include "train/checkpoint.hpp"
#include "losses/autoencoding_reconstruction.hpp"
#include "losses/cross_entropy.hpp"
#include "train/clip.hpp"
#include "models/compressive_memory.hpp"
#include "train/optimizer.hpp"
#include "io/safetensors.hpp"
#include "train/schedule.hpp"
#include "train/text_data.hpp"
#include "trainer/metrics.hpp"
#include "trainer/streams.hpp"
#include "trainer/trainer.hpp"
