// The words prediction and measurement share, so that fsdp-plan, fsdp-sim and fsdp-run report the
// same memory categories under the same keys, count collectives in the same bus-bandwidth terms
// and speak of the same byte units. Phase names are in core/phase.h.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace fsdp {

/// Where device (or heap) bytes go. Every estimate and measurement is a CategoryBytes; each report
/// shows the categories it holds (kPlannerCategories, kRuntimeCategories).
enum class MemCategory {
  kShardedParams,    ///< the rank's fp32 shard of every unit (FlatParameter._local_shard), and model state each rank holds whole (QLoRA's quantization state, torchtitan's RoPE table)
  kUnshardedParams,  ///< all-gathered parameters in param_dtype (plus freed buffers the allocator cannot reuse yet)
  kGradients,        ///< unsharded gradients while computed, sharded fp32 gradients after reduce-scatter
  kOptimizerStates,  ///< optimizer state (and the optimizer step's temporaries)
  kActivations,      ///< tensors saved for backward, logits, loss buffers, backward transients
  kCommBuffers,      ///< all-gather inputs/outputs and reduce-scatter inputs/outputs outside the above
  kTemporaries,      ///< fsdp-run: its engines' working buffers outside the above (the rest of the heap on CPU)
  kFramework,        ///< fsdp-plan: CUDA context, NCCL buffers, cuBLAS workspace, allocator fragmentation
};
constexpr int kMemCategoryCount = 8;
using CategoryBytes = std::array<int64_t, kMemCategoryCount>;

/// The categories of fsdp-plan's estimates of PyTorch (no engine temporaries).
constexpr std::array<MemCategory, 7> kPlannerCategories = {MemCategory::kShardedParams, MemCategory::kUnshardedParams, MemCategory::kGradients,
                                                           MemCategory::kOptimizerStates, MemCategory::kActivations, MemCategory::kCommBuffers,
                                                           MemCategory::kFramework};
/// The categories fsdp-run's engines count (no framework terms: measured apart).
constexpr std::array<MemCategory, 7> kRuntimeCategories = {MemCategory::kShardedParams, MemCategory::kUnshardedParams, MemCategory::kGradients,
                                                           MemCategory::kOptimizerStates, MemCategory::kActivations, MemCategory::kCommBuffers,
                                                           MemCategory::kTemporaries};

/// JSON/report key of a category, e.g. "sharded_params".
std::string_view MemCategoryKey(MemCategory c);
/// Human label, e.g. "sharded parameters".
std::string_view MemCategoryLabel(MemCategory c);
inline int64_t& At(CategoryBytes& bytes, MemCategory c) { return bytes[static_cast<int>(c)]; }
inline int64_t At(const CategoryBytes& bytes, MemCategory c) { return bytes[static_cast<int>(c)]; }
int64_t TotalBytes(const CategoryBytes& bytes);

/// The collectives FSDP issues.
enum class Collective { kAllGather, kReduceScatter, kAllReduce };
std::string_view CollectiveName(Collective c);  ///< "all_gather", "reduce_scatter", "all_reduce"

/// nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md): busbw = algbw x (n-1)/n for all-gather
/// and reduce-scatter, x 2(n-1)/n for all-reduce; 0 for a group of one rank (nothing moves).
double BusFactor(Collective c, int64_t ranks);

/// Byte units: binary (MiB, GiB) for memory, decimal (MB, GB) for traffic and bandwidth.
constexpr double kMiB = 1024.0 * 1024.0;            ///< 2^20 bytes
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;   ///< 2^30 bytes
constexpr double kMB = 1e6;                         ///< 10^6 bytes
constexpr double kGB = 1e9;                         ///< 10^9 bytes

}  // namespace fsdp
