// Measures the machine fsdp-run runs on: GEMM FLOP/s at the model's shapes, memory bandwidth, and
// all-gather / reduce-scatter / all-reduce times across sizes through the Comm backend; returns a
// hardware JSON document fsdp-plan and fsdp-sim accept with --gpu path.
#pragma once

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

/// Runs the measurements (collectives on every rank of `comm`); rank 0's document is the result.
Result<Json> Calibrate(const ModelSpec& model, Comm& comm, const CalibrationOptions& options);

}  // namespace fsdp::runtime
