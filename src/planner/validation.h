// The models against published measurements: nccl-tests bus bandwidths (docs/data/nccl_reference.json)
// and FSDP training throughput (docs/data/published_results.json). Used by bench/collective_check,
// bench/accuracy_check and the tests that keep the errors from regressing.
#pragma once

#include <string>
#include <vector>

#include "core/json_io.h"
#include "core/workload.h"
#include "planner/collective_model.h"

namespace fsdp {

struct CollectiveComparison {
  std::string gpu;
  int64_t ranks = 0, nodes = 0, size_bytes = 0;
  Collective collective = Collective::kAllReduce;
  double measured_busbw = 0;   ///< GB/s
  CollectiveEstimate model;
};

/// One row per published nccl-tests point whose platform is known (GPU and NIC per GPU).
std::vector<CollectiveComparison> CompareNcclTests(const Json& reference);

struct ThroughputComparison {
  std::string id;
  Workload workload;
  double published_tokens_per_s_per_gpu = 0;
  double predicted_tokens_per_s_per_gpu = 0;
  double published_memory_gib = -1;   ///< -1 when not published
  double predicted_memory_gib = 0;
};

/// One row per llama-architecture result with tokens/s per GPU and no torch.compile, predicted
/// with the hardware files' constants.
std::vector<ThroughputComparison> ComparePublishedResults(const Json& results);

/// Mean of |predicted / published - 1| over rows (0 for none).
double MeanAbsoluteError(const std::vector<ThroughputComparison>& rows);
double MeanAbsoluteError(const std::vector<CollectiveComparison>& rows);

/// Tokens/s per GPU of `workload` with its matmul efficiency replaced by `matmul_efficiency`.
double PredictTokensPerGpu(Workload workload, double matmul_efficiency);

}  // namespace fsdp
