// What the attention kernels (csrc/cpu/attention.cpp) know about one tile of scores,
// shared with the host code that fills it (csrc/attention.cpp).
#pragma once
#include <cstdint>

#include "kernels.h"

namespace fusedlm::cpu {

// A [rows, cols] tile of scores Q K^T, dense and row-major in the accumulation type,
// for a block of queries against a block of (gathered) keys.
struct AttnTile {
  DType dtype;  // of the inputs and of the bias
  int64_t rows, cols;
  // Row r may attend to columns [0, limit[r]) only (causal masking, end of the keys).
  const int32_t* limit;
  // The scores are scale * (Q K^T) + bias.
  double scale;
  // Bias of (r, j) at bias[r * bias_row + key_pos[j] * bias_col] (strides may be 0), or null.
  const void* bias;
  int64_t bias_row, bias_col;
  // The original position (in its sequence) of the key of each column.
  const int32_t* key_pos;
  // Dropout keep mask [rows, cols] and probability, or null.
  const uint8_t* keep;
  double p;
};

}  // namespace fusedlm::cpu
