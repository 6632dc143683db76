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
                                                         shard_grad_(w.units.size(), kNoBlock), block_unit_(w.BlockUnits()) {
    const ModelSpec& m = w.model;
    tokens_ = w.TokensPerMicroBatch();
    hidden_bytes_ = tokens_ * m.hidden_size * 4;
    head_bytes_ = (2 * tokens_ * m.vocab_size + 2 * tokens_ * m.hidden_size) * 4;  // logits, d_logits, normed, x
    block_bytes_ = RuntimeBlockSavedBytes(w);
    core_bytes_ = RuntimeAttentionCoreBytes(w);
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

  int UnitOfBlock(int b) const { return block_unit_[b]; }

  void MicroBatch() {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    const bool selective = w_.config.checkpointing == Checkpointing::kSelective;
    const int layers = static_cast<int>(w_.model.num_layers);
    std::vector<BlockId> saved(static_cast<size_t>(layers), kNoBlock);
    Unshard(0);
    BlockId x = mem_.Alloc(Cat::kActivations, hidden_bytes_);
    for (int b = 0; b < layers; ++b) {
      const int u = UnitOfBlock(b);
      Unshard(u);
      if (w_.config.forward_prefetch && b + 1 < layers && UnitOfBlock(b + 1) != u) Prefetch(UnitOfBlock(b + 1));
      saved[b] = mem_.Alloc(Cat::kActivations, ac ? hidden_bytes_ : selective ? block_bytes_ - core_bytes_ : block_bytes_);
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
      BlockId recompute = ac ? mem_.Alloc(Cat::kActivations, block_bytes_) : selective ? mem_.Alloc(Cat::kActivations, core_bytes_) : kNoBlock;
      BlockId dx = mem_.Alloc(Cat::kActivations, hidden_bytes_);  // the gradient flowing back
      mem_.Free(dx);
      mem_.Free(recompute);
      mem_.Free(saved[b]);
      if (u != 0 && w_.FreesInBackward(reduce_now_)) mem_.Free(full_[u]);  // reshard, BACKWARD_POST prefetch, reduce
      if (w_.config.backward_prefetch == BackwardPrefetch::kPost && previous != u) Prefetch(previous);
      if (u != 0 && reduce_now_) Reduce(u);  // under no_sync the unsharded gradient is kept
    }
    mem_.Free(head);
    if (w_.FreesInBackward(reduce_now_)) mem_.Free(full_[0]);
    if (reduce_now_) Reduce(0);
  }

  const Workload& w_;
  MemoryTracker& mem_;
  std::vector<BlockId> full_, grad_, shard_grad_;
  int64_t tokens_ = 0, hidden_bytes_ = 0, head_bytes_ = 0, block_bytes_ = 0, core_bytes_ = 0;
  bool reduce_now_ = true;
  std::vector<int> block_unit_;  // Workload::BlockUnits
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

int64_t RuntimeAttentionCoreBytes(const Workload& w) {
  return w.config.micro_batch * w.model.num_heads * w.config.seq_len * w.config.seq_len * 4;
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
  const ComputeModel cm = EstimateCompute(w, kFusedEngineTrafficPerSavedByte);
  // The engine's own passes over its flat buffers, memory-bound: per unshard the rounded input
  // copy (read + write the shard) and the zero-filled output (write the padded unit); per
  // reduction the rounding of the gradient (read + write), its zero fill, and the accumulation
  // into the fp32 shard (read + write).
  const Schedule schedule = BuildSchedule(w);
  const CommVolume v = EstimateComm(w, schedule).volume;
  double pass_bytes = 0;
  const double reductions = static_cast<double>(schedule.Reductions());
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const double shard = static_cast<double>(w.units[u].shard_numel) * 4, padded = static_cast<double>(w.units[u].padded_numel) * 4;
    const double gathers = static_cast<double>(schedule.Unshards(u));
    pass_bytes += gathers * (2 * shard + padded) + reductions * (3 * padded + 2 * shard);
  }
  const double passes_s = pass_bytes / (w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency);
  return cm.compute_s_per_step + v.total_comm_s + passes_s;
}

}  // namespace fsdp

namespace fsdp {
namespace {

// Mirrors the GPU engine's calls to its DeviceAllocator, in the same order (cuda_engine.cc,
// cuda_block.cc); a change there needs the same change here.
class GpuRuntimePlayer {
 public:
  enum Cat { kSharded, kUnsharded, kGrads, kOptim, kActs, kComm, kTemp };
  using Id = int;

  explicit GpuRuntimePlayer(const Workload& w) : w_(w), full_(w.units.size(), -1), grad_(w.units.size(), -1), shard_grad_(w.units.size(), -1) {
    const ModelSpec& m = w.model;
    e_ = BytesPerElement(w.config.param_dtype);
    T_ = w.TokensPerMicroBatch();
    h_ = m.hidden_size;
    qd_ = m.num_heads * m.head_dim;
    kvd_ = m.num_kv_heads * m.head_dim;
    I_ = m.intermediate_size;
    scores_ = w.config.micro_batch * m.num_heads * w.config.seq_len * w.config.seq_len;
    block_unit_ = w.BlockUnits();
  }

  GpuRuntimeMemory Play() {
    phase_ = "initialisation";
    Free(Alloc(kTemp, 3 * 64 * 64 * 4));  // the cuBLAS probe
    Alloc(kTemp, 4);                       // loss
    Alloc(kTemp, 4);                       // the loss scaler's inf/NaN flag
    Alloc(kTemp, h_ * 4);                  // RMSNorm weight-gradient scratch
    Alloc(kTemp, w_.config.seq_len * w_.model.head_dim * 4);  // RoPE cos and sin table
    for (const auto& u : w_.units) {
      Alloc(kSharded, u.shard_numel * 4);
      Alloc(kOptim, u.shard_numel * 4);
      Alloc(kOptim, u.shard_numel * 4);
    }
    Alloc(kTemp, T_ * 4);  // token ids
    Alloc(kTemp, T_ * 4);  // targets
    Alloc(kTemp, (3 * T_ + 1) * 4);  // the embedding backward's token groups
    for (int64_t micro = 0; micro < w_.config.grad_accum; ++micro) {
      reduce_now_ = !w_.config.no_sync || micro == w_.config.grad_accum - 1;
      Backward(Forward());
    }
    phase_ = "optimizer step";
    for (Id& g : shard_grad_) Free(std::exchange(g, -1));
    return result_;
  }

 private:
  Id Alloc(Cat c, int64_t bytes) {
    const int64_t size = (std::max<int64_t>(bytes, 1) + 511) / 512 * 512;
    sizes_.push_back({c, size});
    live_[c] += size;
    allocated_ += size;
    if (allocated_ > result_.peak_bytes) {
      result_.peak_bytes = allocated_;
      result_.at_peak = live_;
      result_.peak_phase = phase_;
    }
    return static_cast<Id>(sizes_.size() - 1);
  }
  void Free(Id id) {
    if (id < 0 || sizes_[id].second == 0) return;
    live_[sizes_[id].first] -= sizes_[id].second;
    allocated_ -= sizes_[id].second;
    sizes_[id].second = 0;
  }
  void FreeAll(std::initializer_list<Id> ids) {
    for (Id id : ids) Free(id);
  }

  bool ReshardAfterForward(int u) const {
    return !w_.units[u].is_root && (w_.config.strategy == Strategy::kFullShard || w_.config.strategy == Strategy::kHybridShard);
  }
  void Unshard(int u) {
    if (u < 0 || full_[u] >= 0) return;
    phase_ = u == 0 ? "all-gather of the root" : "all-gather of a block";
    const Id low = Alloc(kComm, w_.units[u].shard_numel * e_);
    full_[u] = Alloc(kUnsharded, w_.units[u].padded_numel * e_);
    Free(low);
  }
  void Reshard(int u) { Free(std::exchange(full_[u], -1)); }
  void Reduce(int u) {
    phase_ = u == 0 ? "reduce-scatter of the root" : "reduce-scatter of a block";
    const int64_t re = BytesPerElement(w_.config.reduce_dtype);
    const Id cast = w_.config.reduce_dtype != w_.config.param_dtype ? Alloc(kComm, w_.units[u].padded_numel * re) : -1;
    const Id out = Alloc(kComm, w_.units[u].shard_numel * re);
    if (shard_grad_[u] < 0) shard_grad_[u] = Alloc(kGrads, w_.units[u].shard_numel * 4);
    FreeAll({out, cast});
    Free(std::exchange(grad_[u], -1));
  }
  void EnsureGrad(int u) {
    if (grad_[u] < 0) grad_[u] = Alloc(kGrads, w_.units[u].padded_numel * e_);
  }

  struct Cache {
    Id inv1, n1, q, k, v, probs, attn, x2, inv2, n2, gate, up, mid;
  };
  // DeviceBlockForward: returns y; the cache is kept (activations) or freed (temporaries).
  Id BlockForward(Cache* cache) {
    const Cat c = cache != nullptr ? kActs : kTemp;
    Cache k{};
    k.inv1 = Alloc(c, T_ * 4);
    k.n1 = Alloc(c, T_ * h_ * e_);
    k.q = Alloc(c, T_ * qd_ * e_);
    k.k = Alloc(c, T_ * kvd_ * e_);
    k.v = Alloc(c, T_ * kvd_ * e_);
    k.probs = Alloc(c, scores_ * e_);
    k.attn = Alloc(c, T_ * qd_ * e_);
    k.x2 = Alloc(c, T_ * h_ * e_);
    k.inv2 = Alloc(c, T_ * 4);
    k.n2 = Alloc(c, T_ * h_ * e_);
    k.gate = Alloc(c, T_ * I_ * e_);
    k.up = Alloc(c, T_ * I_ * e_);
    k.mid = Alloc(c, T_ * I_ * e_);
    const Id y = Alloc(kActs, T_ * h_ * e_);
    if (cache != nullptr) {
      *cache = k;
    } else {
      FreeAll({k.inv1, k.n1, k.q, k.k, k.v, k.probs, k.attn, k.x2, k.inv2, k.n2, k.gate, k.up, k.mid});
    }
    return y;
  }
  // DeviceBlockBackward: consumes dy and the cache, returns dx.
  Id BlockBackward(Id dy, const Cache& k) {
    const Id d_mid = Alloc(kTemp, T_ * I_ * e_);
    Free(k.mid);
    const Id d_gate = Alloc(kTemp, T_ * I_ * e_);
    const Id d_n2 = Alloc(kTemp, T_ * h_ * e_);
    FreeAll({d_mid, d_gate, k.gate, k.up});
    const Id d_x2 = Alloc(kTemp, T_ * h_ * e_);
    FreeAll({d_n2, dy, k.n2, k.x2, k.inv2});
    const Id d_attn = Alloc(kTemp, T_ * qd_ * e_);
    Free(k.attn);
    const Id dq = Alloc(kTemp, T_ * qd_ * e_), dk = Alloc(kTemp, T_ * kvd_ * e_), dv = Alloc(kTemp, T_ * kvd_ * e_);
    const Id d_scores = Alloc(kTemp, scores_ * e_);  // DeviceAttentionBackward
    const bool grouped = qd_ != kvd_;
    const Id dk_heads = grouped ? Alloc(kTemp, T_ * qd_ * e_) : -1, dv_heads = grouped ? Alloc(kTemp, T_ * qd_ * e_) : -1;
    FreeAll({d_scores, dk_heads, dv_heads, d_attn, k.probs});
    const Id d_n1 = Alloc(kTemp, T_ * h_ * e_);
    FreeAll({dq, dk, dv, k.q, k.k, k.v, k.n1});
    const Id dx = Alloc(kActs, T_ * h_ * e_);
    FreeAll({k.inv1, d_n1, d_x2});
    return dx;
  }

  Id Forward() {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    const int layers = static_cast<int>(block_unit_.size());
    inputs_.assign(static_cast<size_t>(layers), -1);
    caches_.assign(static_cast<size_t>(layers), Cache{});
    Unshard(0);
    phase_ = "forward of a block";
    Id x = Alloc(kActs, T_ * h_ * e_);
    for (int b = 0; b < layers; ++b) {
      const int u = block_unit_[b];
      Unshard(u);
      if (w_.config.forward_prefetch && b + 1 < layers && block_unit_[b + 1] != u) Unshard(block_unit_[b + 1]);
      phase_ = "forward of a block";
      const Id y = BlockForward(ac ? nullptr : &caches_[b]);
      if (w_.config.checkpointing == Checkpointing::kSelective) Free(std::exchange(caches_[b].probs, -1));
      inputs_[b] = x;
      x = y;
      if (u != 0 && ReshardAfterForward(u)) Reshard(u);
    }
    phase_ = "loss";
    inv_ = Alloc(kActs, T_ * 4);
    normed_ = Alloc(kActs, T_ * h_ * e_);
    logits_ = Alloc(kActs, T_ * w_.model.vocab_size * e_);
    return x;
  }

  void Backward(Id x) {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    phase_ = "backward of the head";
    EnsureGrad(0);
    const Id d_normed = Alloc(kTemp, T_ * h_ * e_);
    FreeAll({logits_, normed_});
    Id dx = Alloc(kActs, T_ * h_ * e_);
    FreeAll({d_normed, inv_, x});
    for (int b = static_cast<int>(block_unit_.size()) - 1; b >= 0; --b) {
      const int u = block_unit_[b];
      const int previous = b > 0 ? block_unit_[b - 1] : -1;
      Unshard(u);
      if (w_.config.backward_prefetch == BackwardPrefetch::kPre && previous > 0 && previous != u) Unshard(previous);
      phase_ = "backward of a block";
      EnsureGrad(u);
      if (ac) Free(BlockForward(&caches_[b]));
      if (w_.config.checkpointing == Checkpointing::kSelective) caches_[b].probs = Alloc(kActs, scores_ * e_);
      dx = BlockBackward(dx, caches_[b]);
      Free(inputs_[b]);
      if (u != 0 && w_.FreesInBackward(reduce_now_)) Reshard(u);  // reshard, BACKWARD_POST prefetch, reduce: as the engine
      if (w_.config.backward_prefetch == BackwardPrefetch::kPost && previous > 0 && previous != u) Unshard(previous);
      if (u != 0 && reduce_now_) Reduce(u);
    }
    Free(dx);
    if (w_.FreesInBackward(reduce_now_)) Reshard(0);
    if (reduce_now_) Reduce(0);
  }

  const Workload& w_;
  int64_t e_ = 2, T_ = 0, h_ = 0, qd_ = 0, kvd_ = 0, I_ = 0, scores_ = 0;
  std::vector<int> block_unit_;
  std::vector<Id> full_, grad_, shard_grad_, inputs_;
  std::vector<Cache> caches_;
  Id inv_ = -1, normed_ = -1, logits_ = -1;
  bool reduce_now_ = true;
  std::vector<std::pair<Cat, int64_t>> sizes_;
  std::array<int64_t, 7> live_{};
  int64_t allocated_ = 0;
  std::string phase_;
  GpuRuntimeMemory result_;
};

}  // namespace

GpuRuntimeMemory EstimateGpuRuntimeMemory(const Workload& workload) { return GpuRuntimePlayer(workload).Play(); }

}  // namespace fsdp
