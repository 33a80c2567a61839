#pragma once
// The compression functions of the Compressive Transformer, one per file under nn/compression/:
//   conv.hpp           conv_compression (the paper's and labml's Conv1d, kernel = stride = rate)
//   pooling.hpp        max_pool_compression, mean_pool_compression
//   dilated_conv.hpp   dilated_conv_compression (a stack of log2(rate) stride-2 convolutions)
//   most_used.hpp      most_used_compression (keeps the most-attended slot of each window)
//   none.hpp           no_compression (Transformer-XL: a model that never compresses)
//   common.hpp         the shape rules they share, and compression_needs_usage<C>
#include "compression/common.hpp"
#include "compression/conv.hpp"
#include "compression/dilated_conv.hpp"
#include "compression/most_used.hpp"
#include "compression/none.hpp"
#include "compression/pooling.hpp"
