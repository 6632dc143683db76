// Measures the machine fsdp-run runs on: GEMM FLOP/s at the model's shapes, memory bandwidth, and
// all-gather / reduce-scatter / all-reduce times across sizes through the Comm backend; returns a
// hardware JSON document fsdp-plan and fsdp-sim accept with --gpu path.
#pragma once

#include <utility>
#include <vector>

#include "core/json_io.h"
#include "core/model_spec.h"
#include "runtime/comm.h"

namespace fsdp::runtime {

struct CalibrationOptions {
  int64_t tokens = 256;      ///< rows of the GEMMs (micro-batch x sequence)
  int64_t seq_len = 256;     ///< sequence length of the attention measurement
  int repeats = 3;           ///< best of
  int64_t max_collective_bytes = 16 << 20;
};

/// (out, in) of the model's linear layers whose rate the calibration measures: q, kv, o, the MLP's
/// up and down projections, the LM head.
std::vector<std::pair<int64_t, int64_t>> LinearShapes(const ModelSpec& model);

/// FLOPs of the engines' attention, forward and backward, over the full s x s scores (as their
/// kernels compute them): 3 x 4 s d per token and head.
double AttentionTrainingFlops(const ModelSpec& model, int64_t batch, int64_t seq);

/// One row of measured_collectives: nccl-tests sizes and bus bandwidths of an all-gather,
/// reduce-scatter and all-reduce of `bytes` over `ranks`.
Json CollectiveRow(int ranks, int64_t bytes, double all_gather_s, double reduce_scatter_s, double all_reduce_s);

/// Runs the measurements (collectives on every rank of `comm`); rank 0's document is the result.
Result<Json> Calibrate(const ModelSpec& model, Comm& comm, const CalibrationOptions& options);

}  // namespace fsdp::runtime
