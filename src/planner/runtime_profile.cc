#include "planner/runtime_profile.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "planner/comm_model.h"
#include "planner/compute_model.h"
#include "planner/memory_tracker.h"

namespace fsdp {
namespace {

using Cat = MemCategory;

// Replays fsdp-run's FsdpEngine::MicroBatch / Reduce / Optimizer allocations.
class RuntimePlayer {
 public:
  RuntimePlayer(const Workload& w, MemoryTracker& mem) : w_(w), mem_(mem), full_(w.units.size(), kNoBlock), grad_(w.units.size(), kNoBlock),
                                                         shard_grad_(w.units.size(), kNoBlock) {
    const ModelSpec& m = w.model;
    tokens_ = w.TokensPerMicroBatch();
    hidden_bytes_ = tokens_ * m.hidden_size * 4;
    head_bytes_ = (2 * tokens_ * m.vocab_size + 2 * tokens_ * m.hidden_size) * 4;  // logits, d_logits, normed, x
    block_bytes_ = RuntimeBlockSavedBytes(w);
  }

  void Play() {
    for (const auto& u : w_.units) {
      mem_.Alloc(Cat::kShardedParams, u.shard_numel * 4);
      mem_.Alloc(Cat::kOptimizerStates, 2 * u.shard_numel * 4);
    }
    for (int64_t micro = 0; micro < w_.config.grad_accum; ++micro) {
      reduce_now_ = !w_.config.no_sync || micro == w_.config.grad_accum - 1;
      MicroBatch();
    }
  }

 private:
  // FsdpEngine::Prefetch: the input copy stays alive until the all-gather is waited for.
  void Prefetch(int u) {
    if (u <= 0 || full_[u] != kNoBlock || w_.config.strategy == Strategy::kNoShard) return;
    const size_t limit = w_.config.limit_all_gathers ? 2 : SIZE_MAX;
    while (in_flight_.size() >= limit) WaitOldest();
    in_flight_.push_back({u, mem_.Alloc(Cat::kCommBuffers, w_.units[u].shard_numel * 4)});
    full_[u] = mem_.Alloc(Cat::kUnshardedParams, w_.units[u].padded_numel * 4);
  }

  void WaitOldest() {
    mem_.Free(in_flight_.front().second);
    in_flight_.erase(in_flight_.begin());
  }

  void Unshard(int u) {
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      if (in_flight_[i].first == u) {
        mem_.Free(in_flight_[i].second);
        in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
    if (full_[u] != kNoBlock) return;
    BlockId low = mem_.Alloc(Cat::kCommBuffers, w_.units[u].shard_numel * 4);
    full_[u] = mem_.Alloc(Cat::kUnshardedParams, w_.units[u].padded_numel * 4);
    mem_.Free(low);
  }

  void Reduce(int u) {
    BlockId shard = mem_.Alloc(Cat::kCommBuffers, w_.units[u].shard_numel * 4);
    if (shard_grad_[u] == kNoBlock) shard_grad_[u] = mem_.Alloc(Cat::kGradients, w_.units[u].shard_numel * 4);
    mem_.Free(shard);
    mem_.Free(grad_[u]);
  }

  bool Reshards(int u) const {
    return !w_.units[u].is_root && (w_.config.strategy == Strategy::kFullShard || w_.config.strategy == Strategy::kHybridShard);
  }

  int UnitOfBlock(int b) const {
    for (const auto& n : w_.nodes) if (n.role == ModuleNode::Role::kBlock && n.block == b) return std::max(0, n.unit);
    return 0;
  }

  void MicroBatch() {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    const int layers = static_cast<int>(w_.model.num_layers);
    std::vector<BlockId> saved(static_cast<size_t>(layers), kNoBlock);
    Unshard(0);
    BlockId x = mem_.Alloc(Cat::kActivations, hidden_bytes_);
    for (int b = 0; b < layers; ++b) {
      const int u = UnitOfBlock(b);
      Unshard(u);
      if (w_.config.forward_prefetch && b + 1 < layers && UnitOfBlock(b + 1) != u) Prefetch(UnitOfBlock(b + 1));
      saved[b] = mem_.Alloc(Cat::kActivations, ac ? hidden_bytes_ : block_bytes_);
      if (u != 0 && Reshards(u)) mem_.Free(full_[u]);
    }
    mem_.Free(x);
    BlockId head = mem_.Alloc(Cat::kActivations, head_bytes_);
    if (grad_[0] == kNoBlock) grad_[0] = mem_.Alloc(Cat::kGradients, w_.units[0].padded_numel * 4);
    for (int b = layers - 1; b >= 0; --b) {
      const int u = UnitOfBlock(b);
      Unshard(u);
      const int previous = b > 0 ? UnitOfBlock(b - 1) : -1;
      if (w_.config.backward_prefetch == BackwardPrefetch::kPre && previous != u) Prefetch(previous);
      if (grad_[u] == kNoBlock) grad_[u] = mem_.Alloc(Cat::kGradients, w_.units[u].padded_numel * 4);
      BlockId recompute = ac ? mem_.Alloc(Cat::kActivations, block_bytes_) : kNoBlock;
      BlockId dx = mem_.Alloc(Cat::kActivations, hidden_bytes_);  // the gradient flowing back
      mem_.Free(dx);
      mem_.Free(recompute);
      mem_.Free(saved[b]);
      if (w_.config.backward_prefetch == BackwardPrefetch::kPost && previous != u) Prefetch(previous);
      if (u != 0) {
        mem_.Free(full_[u]);
        if (reduce_now_) Reduce(u);  // under no_sync the unsharded gradient is kept
      }
    }
    mem_.Free(head);
    mem_.Free(full_[0]);
    if (reduce_now_) Reduce(0);
  }

  const Workload& w_;
  MemoryTracker& mem_;
  std::vector<BlockId> full_, grad_, shard_grad_;
  int64_t tokens_ = 0, hidden_bytes_ = 0, head_bytes_ = 0, block_bytes_ = 0;
  bool reduce_now_ = true;
  std::vector<std::pair<int, BlockId>> in_flight_;  // (unit, its all-gather input)
};

}  // namespace

int64_t RuntimeBlockSavedBytes(const Workload& w) {
  const ModelSpec& m = w.model;
  const int64_t t = w.TokensPerMicroBatch();
  const int64_t floats = 4 * t * m.hidden_size + 2 * t * m.num_heads * m.head_dim + 2 * t * m.num_kv_heads * m.head_dim +
                         3 * t * m.intermediate_size + 2 * t + w.config.micro_batch * m.num_heads * w.config.seq_len * w.config.seq_len;
  return floats * 4;
}

MemoryEstimate EstimateRuntimeMemory(const Workload& w) {
  MemoryTracker mem(1, false);
  RuntimePlayer(w, mem).Play();
  MemoryEstimate e;
  e.peak = mem.device_peak();
  e.peak_bytes = TotalBytes(e.peak);
  e.allocated_peak_bytes = mem.allocated_peak();
  return e;
}

double EstimateRuntimeStepSeconds(const Workload& workload) {
  Workload w = workload;
  w.config.attention = Attention::kEager;
  w.config.param_dtype = w.config.reduce_dtype = DType::kFp32;
  const ComputeModel cm = EstimateCompute(w);
  // The engine's own passes over its flat buffers, memory-bound: per all-gather the rounded input
  // copy (read + write the shard) and the zero-filled output (write the padded unit); per
  // reduction the rounding of the gradient (read + write), its zero fill, and the accumulation
  // into the fp32 shard (read + write).
  const CommVolume v = EstimateComm(w).volume;
  double pass_bytes = 0;
  const double micro = static_cast<double>(w.config.grad_accum);
  const double reductions = w.config.no_sync ? 1.0 : micro;
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const double shard = static_cast<double>(w.units[u].shard_numel) * 4, padded = static_cast<double>(w.units[u].padded_numel) * 4;
    const double gathers = micro * (1.0 + (RegathersInBackward(w, u) ? 1.0 : 0.0));
    pass_bytes += gathers * (2 * shard + padded) + reductions * (3 * padded + 2 * shard);
  }
  const double passes_s = pass_bytes / (w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency);
  return cm.compute_s_per_step + v.total_comm_s + passes_s;
}

}  // namespace fsdp
