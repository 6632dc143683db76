#include "planner/runtime_profile.h"
#include "core/caching_allocator.h"

#include <limits>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "core/lora.h"
#include "core/schedule.h"
#include "planner/comm_model.h"
#include "planner/compute_model.h"
#include "planner/memory_tracker.h"

namespace fsdp {
namespace {

using Cat = MemCategory;

// Replays fsdp-run's FsdpEngine (src/runtime/fsdp_engine.cc) on the schedule: its Unshard,
// WaitUnshard, ForwardNode, BackwardNode, Reshard and Reduce allocations.
class RuntimePlayer {
 public:
  RuntimePlayer(const Workload& w, MemoryTracker& mem)
      : w_(w), schedule_(BuildSchedule(w)), mem_(mem), phases_(w), full_(w.units.size(), kNoBlock), grad_(w.units.size(), kNoBlock),
        shard_grad_(w.units.size(), kNoBlock), saved_(static_cast<size_t>(w.model.num_layers), kNoBlock),
        compute_(w.units.size(), kNoBlock) {
    const ModelSpec& m = w.model;
    tokens_ = w.TokensPerMicroBatch();
    hidden_bytes_ = tokens_ * m.hidden_size * 4;
    head_bytes_ = (tokens_ * m.vocab_size + 2 * tokens_ * m.hidden_size) * 4;  // d_logits, normed, x: to the embedding's backward
    logits_bytes_ = tokens_ * m.vocab_size * 4;                                // the logits: at the loss only
    block_bytes_ = RuntimeBlockSavedBytes(w);
    core_bytes_ = RuntimeAttentionCoreBytes(w);
  }

  void Play() {
    mem_.SetPhase(Phase{StepPhase::kInitialisation});
    const int64_t rank = FullestStateRank();
    for (int u = 0; u < static_cast<int>(w_.units.size()); ++u) {
      // the frozen group's shard in the frozen base's dtype, the trained group's in the master dtype (ShardBuffer)
      const int64_t trained = w_.units[u].grad_shard_numel;
      mem_.Alloc(Cat::kShardedParams, (w_.units[u].shard_numel - trained) * frozen_bytes_ + trained * master_bytes_);
      mem_.Alloc(Cat::kOptimizerStates, 2 * SteppedNumel(u, rank) * master_bytes_);  // AdamW's states
    }
    for (const TensorSpec& t : w_.model.tensors) {  // QLoRA: every quantized weight's state, on every rank
      if (t.nf4_numel > 0) mem_.Alloc(Cat::kShardedParams, Nf4EngineStateBytes(t.nf4_numel, w_.config.lora.double_quant));
    }
    for (int64_t micro = 0; micro < w_.config.grad_accum; ++micro) {
      phases_.StartMicroBatch(static_cast<int>(micro));
      for (const Action& a : schedule_.MicroBatch(micro)) Play(a);
    }
  }

 private:
  int64_t SteppedNumel(int u, int64_t rank) const {
    int64_t numel = 0;
    for (const ElementRun& run : SteppedShardRuns(w_, u, rank)) numel += run.numel;
    return numel;
  }

  // The shard rank whose AdamW holds the most states: they differ by rank only under FSDP1 with
  // frozen parameters (SteppedShardRuns), where the fullest rank's are the ones that count.
  int64_t FullestStateRank() const {
    int64_t fullest = 0, most = -1;
    for (int64_t r = 0; r < w_.shard_world; ++r) {
      int64_t total = 0;
      for (int u = 0; u < static_cast<int>(w_.units.size()); ++u) total += SteppedNumel(u, r);
      if (total > most) std::tie(fullest, most) = std::pair{r, total};
    }
    return fullest;
  }

  // In the phases FsdpEngine gives its ledger: the same tracker on the same actions.
  void Play(const Action& a) {
    if (phases_.Enter(a)) mem_.SetPhase(phases_.phase());
    switch (a.kind) {
      case ActionKind::kUnshard: Unshard(a.unit, a.prefetch); break;
      case ActionKind::kWaitUnshard: Wait(a.unit); break;
      case ActionKind::kForward:
      case ActionKind::kBackward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) {
          if (phases_.Enter(v, a.kind == ActionKind::kForward)) mem_.SetPhase(phases_.phase());
          if (a.kind == ActionKind::kForward) Forward(v.node);
          else if (v.enter) Backward(v.node);
        }
        break;
      case ActionKind::kReshard: Reshard(a.unit); break;
      case ActionKind::kReduce: Reduce(a.unit); break;
      default: break;
    }
  }

  // FsdpEngine::Unshard: a prefetch's input copy stays alive until it is waited for.
  void Unshard(int u, bool prefetch) {
    BlockId low = mem_.Alloc(Cat::kCommBuffers, w_.units[u].shard_numel * 4);
    full_[u] = mem_.Alloc(Cat::kUnshardedParams, w_.units[u].padded_numel * 4);
    if (prefetch && w_.config.strategy != Strategy::kNoShard) {
      in_flight_.emplace_back(u, low);
      return;
    }
    mem_.Free(low);
    Dequantize(u);
  }

  void Wait(int u) {
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      if (in_flight_[i].first != u) continue;
      mem_.Free(in_flight_[i].second);
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      Dequantize(u);
      return;
    }
  }

  // FsdpEngine::Dequantize (QLoRA): the unit's own tensors in fp32, quantized weights dequantized,
  // until its reshard
  void Dequantize(int u) {
    if (const int64_t numel = Nf4ComputeNumel(w_.model, w_.units[u].tensors); numel > 0) compute_[u] = mem_.Alloc(Cat::kUnshardedParams, numel * 4);
  }

  void Reshard(int u) {
    mem_.Free(full_[u]);
    mem_.Free(compute_[u]);
  }

  // FsdpEngine::Reduce: the trained group's gradient (grad_padded_numel), nothing for a frozen unit.
  void Reduce(int u) {
    if (w_.units[u].grad_shard_numel == 0) return;
    BlockId shard = mem_.Alloc(Cat::kCommBuffers, w_.units[u].grad_shard_numel * 4);
    if (shard_grad_[u] == kNoBlock) shard_grad_[u] = mem_.Alloc(Cat::kGradients, w_.units[u].grad_shard_numel * master_bytes_);
    mem_.Free(shard);
    mem_.Free(grad_[u]);
  }

  // FsdpEngine::Grads: the unit's unsharded gradient (its trained group), from its first backward
  // on; none for a unit with nothing to train.
  void EnsureGrad(int node) {
    const int u = w_.tensor_unit[w_.WeightTensor(node)];
    if (grad_[u] == kNoBlock && w_.units[u].grad_padded_numel > 0) grad_[u] = mem_.Alloc(Cat::kGradients, w_.units[u].grad_padded_numel * 4);
  }

  void Forward(int node) {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    const bool selective = w_.config.checkpointing == Checkpointing::kSelective;
    switch (w_.nodes[node].role) {
      case ModuleNode::Role::kEmbedding: x_ = mem_.Alloc(Cat::kActivations, hidden_bytes_); break;
      case ModuleNode::Role::kBlock:
        saved_[w_.nodes[node].block] = mem_.Alloc(Cat::kActivations, ac ? hidden_bytes_ : selective ? block_bytes_ - core_bytes_ : block_bytes_);
        break;
      case ModuleNode::Role::kFinalNorm: mem_.Free(x_); break;
      case ModuleNode::Role::kLmHead: {
        head_ = mem_.Alloc(Cat::kActivations, head_bytes_);
        BlockId logits = mem_.Alloc(Cat::kActivations, logits_bytes_);
        mem_.Free(logits);
        break;
      }
      case ModuleNode::Role::kOther: break;
    }
  }

  void Backward(int node) {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    const bool selective = w_.config.checkpointing == Checkpointing::kSelective;
    switch (w_.nodes[node].role) {
      case ModuleNode::Role::kLmHead:
        if (w_.model.tensors[w_.WeightTensor(node)].trainable) EnsureGrad(node);  // a frozen head passes only the input's gradient
        break;
      case ModuleNode::Role::kBlock: {
        EnsureGrad(node);
        BlockId recompute = ac ? mem_.Alloc(Cat::kActivations, block_bytes_) : selective ? mem_.Alloc(Cat::kActivations, core_bytes_) : kNoBlock;
        BlockId dx = mem_.Alloc(Cat::kActivations, hidden_bytes_);  // the gradient flowing back
        mem_.Free(dx);
        mem_.Free(recompute);
        mem_.Free(saved_[w_.nodes[node].block]);
        break;
      }
      case ModuleNode::Role::kEmbedding: mem_.Free(head_); break;
      default: break;
    }
  }

  const Workload& w_;
  Schedule schedule_;
  MemoryTracker& mem_;
  PhaseTracker phases_;
  std::vector<BlockId> full_, grad_, shard_grad_, saved_, compute_;
  BlockId x_ = kNoBlock, head_ = kNoBlock;
  int64_t tokens_ = 0, hidden_bytes_ = 0, head_bytes_ = 0, logits_bytes_ = 0, block_bytes_ = 0, core_bytes_ = 0;
  int64_t master_bytes_ = BytesPerElement(w_.config.master_dtype);  // the shards', gradient shards' and states' element
  int64_t frozen_bytes_ = BytesPerElement(FrozenStorageDtype(w_.config));  // a frozen group's shard's element
  std::vector<std::pair<int, BlockId>> in_flight_;  // (unit, its all-gather input)
};

}  // namespace

int64_t RuntimeBlockSavedBytes(const Workload& w) {
  const ModelSpec& m = w.model;
  const int64_t t = w.TokensPerMicroBatch();
  const int64_t outside_mlp = 4 * t * m.hidden_size + 2 * t * m.num_heads * m.head_dim + 2 * t * m.num_kv_heads * m.head_dim + 2 * t +
                            w.config.micro_batch * m.num_heads * w.config.seq_len * w.config.seq_len;
  // the MLP: gate, up and mid (T, I); routed experts: per (token, expert) pair instead, with each
  // pair's expert output (T k, h), the router's softmax (T, E) and weights (T, k), each pair's token
  // and slot (int32) and where each expert's pairs begin (E + 1 int64)
  const int64_t pairs = t * m.experts_per_token;
  const int64_t mlp_bytes = m.arch.mlp == MlpKind::kMoe ? (3 * pairs * m.intermediate_size + pairs * m.hidden_size + t * m.num_experts + pairs) * 4 +
                                                              2 * pairs * 4 + (m.num_experts + 1) * 8
                                                        : 3 * t * m.intermediate_size * 4;
  // Qwen3's q/k norms: q and k before them, one head per row, and each row's inverse RMS (BlockCache)
  const bool head_norms = std::any_of(m.arch.block.begin(), m.arch.block.end(), [](const ParamOp& op) { return op.qk_norm && op.head_norm; });
  const int64_t head_rows = t * (m.num_heads + m.num_kv_heads);
  // LoRA: each adapted projection's x A^T (T, r), for lora_B's gradient; with dropout its output
  // (T, in) floats, lora_A's input, and its keep mask (T x in bytes)
  int64_t lora = 0, dropout_masks = 0;
  for (const ParamOp& op : m.arch.block) {
    lora += t * op.lora_rank;
    if (op.lora_rank > 0 && op.lora_dropout > 0) {
      lora += t * op.in;
      dropout_masks += t * op.in;
    }
  }
  return (outside_mlp + (head_norms ? head_rows * m.head_dim + head_rows : 0) + lora) * 4 + mlp_bytes + dropout_masks;
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
  e.peak_phase = PhaseName(w, mem.device_peak_phase());
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
  // into the gradient shard (read + write; counted at fp32 sizes).
  const Schedule schedule = BuildSchedule(w);
  const CommVolume v = EstimateComm(w, schedule).volume;
  double pass_bytes = 0;
  const double reductions = static_cast<double>(schedule.Reductions());
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const double shard = static_cast<double>(w.units[u].shard_numel) * 4, padded = static_cast<double>(w.units[u].padded_numel) * 4;
    // what is reduced: the trained group (all of the unit in full training)
    const double grad_shard = static_cast<double>(w.units[u].grad_shard_numel) * 4, grad = static_cast<double>(w.units[u].grad_padded_numel) * 4;
    const double gathers = static_cast<double>(schedule.Unshards(u));
    pass_bytes += gathers * (2 * shard + padded) + reductions * (3 * grad + 2 * grad_shard);
  }
  const double passes_s = pass_bytes / (w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency);
  return cm.compute_s_per_step + v.total_comm_s + passes_s;
}

}  // namespace fsdp

namespace fsdp {
namespace {

// The engine's allocator settings: --alloc-conf as the engine parses it (a run with a setting it
// refuses never starts, so the default stands in for one).
AllocatorConfig EngineAllocatorConfig(const Workload& w) {
  auto parsed = ParseAllocatorConfig(w.config.alloc_conf);
  return parsed.ok() ? parsed.value() : AllocatorConfig{};
}

// Mirrors the GPU engine's calls to its DeviceAllocator on the same schedule, in the same order
// (cuda_engine.cc's Unshard, ForwardNode, BackwardNode, Reshard and Reduce; cuda_block.cc).
class GpuRuntimePlayer {
 public:
  using Cat = MemCategory;
  static constexpr Cat kSharded = Cat::kShardedParams, kUnsharded = Cat::kUnshardedParams, kGrads = Cat::kGradients,
                       kOptim = Cat::kOptimizerStates, kActs = Cat::kActivations, kComm = Cat::kCommBuffers, kTemp = Cat::kTemporaries;
  using Id = int;

  /// When the blocks freed after another stream used them become reusable: at the engine's next
  /// allocation (the GPU keeps up with the host), or only at the end of the step (the host runs a
  /// whole step ahead, waiting only for the loss).
  enum class EventsPass { kNextAllocation, kEndOfStep };

  GpuRuntimePlayer(const Workload& w, EventsPass events_pass)
      : events_pass_(events_pass), w_(w), schedule_(BuildSchedule(w)), full_(w.units.size(), -1), grad_(w.units.size(), -1), shard_grad_(w.units.size(), -1),
        phases_(w), device_(std::numeric_limits<int64_t>::max() / 4, w.hardware.DeviceTotalBytes()),
        policy_(EngineAllocatorConfig(w), device_) {
    const ModelSpec& m = w.model;
    e_ = BytesPerElement(w.config.param_dtype);
    T_ = w.TokensPerMicroBatch();
    h_ = m.hidden_size;
    qd_ = m.num_heads * m.head_dim;
    kvd_ = m.num_kv_heads * m.head_dim;
    I_ = m.intermediate_size;
    scores_ = w.config.micro_batch * m.num_heads * w.config.seq_len * w.config.seq_len;
  }

  GpuRuntimeMemory Play() {
    phases_.Enter(StepPhase::kInitialisation);
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
    inputs_.assign(static_cast<size_t>(w_.model.num_layers), -1);
    caches_.assign(static_cast<size_t>(w_.model.num_layers), Cache{});
    for (int step = 0; step < 2; ++step) {  // the allocated series repeats; the second step is where the reserve settles
      for (int64_t micro = 0; micro < w_.config.grad_accum; ++micro) {
        phases_.StartMicroBatch(static_cast<int>(micro));
        for (const Action& a : schedule_.MicroBatch(micro)) Play(a);
      }
      for (Id& g : shard_grad_) FreeUsedOn(std::exchange(g, -1), kComputeStream);  // zero_grad, on the reduce stream's blocks
      PassEvents();  // the host waits for the step's loss
    }
    result_.peak_phase = PhaseName(w_, peak_phase_);
    result_.reserved_peak_bytes = policy_.stats().reserved_peak_bytes;
    return result_;
  }

 private:
  // The engine's streams, numbered as its DeviceAllocator first meets them.
  static constexpr int kComputeStream = 0, kGatherStream = 1, kReduceStream = 2;

  // DeviceAllocator::Allocate: the blocks freed on other streams are reusable first (its
  // ProcessPending: here the GPU has kept up, every recorded event has passed), then the policy's
  // malloc on the stream.
  Id Alloc(Cat c, int64_t bytes, int stream = kComputeStream) {
    if (events_pass_ == EventsPass::kNextAllocation) PassEvents();
    handles_.push_back(policy_.Malloc(std::max<int64_t>(bytes, 1), stream));
    const int64_t size = (std::max<int64_t>(bytes, 1) + 511) / 512 * 512;
    sizes_.push_back({c, size});
    At(live_, c) += size;
    allocated_ += size;
    if (allocated_ > result_.peak_bytes) {
      result_.peak_bytes = allocated_;
      result_.at_peak = live_;
      peak_phase_ = phases_.phase();
    }
    return static_cast<Id>(sizes_.size() - 1);
  }
  void Free(Id id) {
    if (id < 0 || sizes_[id].second == 0) return;
    At(live_, sizes_[id].first) -= sizes_[id].second;
    allocated_ -= sizes_[id].second;
    sizes_[id].second = 0;
    policy_.Free(handles_[id]);
  }
  void PassEvents() {
    for (CachingAllocator::Handle h : pending_) policy_.EventsPassed(h);
    pending_.clear();
  }
  // DeviceBuffer::Release({stream}): the block waits for an event recorded on `stream`.
  void FreeUsedOn(Id id, int stream) {
    if (id < 0 || sizes_[id].second == 0) return;
    policy_.RecordStream(handles_[id], stream);
    pending_.push_back(handles_[id]);
    Free(id);
  }
  void FreeAll(std::initializer_list<Id> ids) {
    for (Id id : ids) Free(id);
  }

  // In the phases the GPU engine tells its allocator: the same tracker on the same actions.
  void Play(const Action& a) {
    phases_.Enter(a);
    switch (a.kind) {
      case ActionKind::kUnshard: Unshard(a.unit); break;
      case ActionKind::kForward:
      case ActionKind::kBackward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) {
          phases_.Enter(v, a.kind == ActionKind::kForward);
          if (a.kind == ActionKind::kForward) Forward(v.node);
          else if (v.enter) Backward(v.node);
        }
        break;
      case ActionKind::kReshard: Reshard(a.unit); break;
      case ActionKind::kReduce: Reduce(a.unit); break;
      default: break;
    }
  }

  void Unshard(int u) {
    if (full_[u] >= 0) return;
    const Id low = Alloc(kComm, w_.units[u].shard_numel * e_, kGatherStream);
    full_[u] = Alloc(kUnsharded, w_.units[u].padded_numel * e_, kGatherStream);
    Free(low);
  }
  void Reshard(int u) { FreeUsedOn(std::exchange(full_[u], -1), kComputeStream); }
  void Reduce(int u) {
    const int64_t re = BytesPerElement(w_.config.reduce_dtype);
    const Id cast = w_.config.reduce_dtype != w_.config.param_dtype ? Alloc(kComm, w_.units[u].padded_numel * re, kReduceStream) : -1;
    const Id out = Alloc(kComm, w_.units[u].shard_numel * re, kReduceStream);
    if (shard_grad_[u] < 0) shard_grad_[u] = Alloc(kGrads, w_.units[u].shard_numel * 4, kReduceStream);
    FreeAll({out, cast});
    FreeUsedOn(std::exchange(grad_[u], -1), kReduceStream);
  }
  // CudaEngine::Grads: the unit's unsharded gradient, from its first backward on.
  void EnsureGrad(int node) {
    const int t = w_.WeightTensor(node);
    const int u = w_.tensor_unit[t];
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

  void Forward(int node) {
    const bool ac = w_.config.checkpointing == Checkpointing::kFull;
    switch (w_.nodes[node].role) {
      case ModuleNode::Role::kEmbedding:
        x_ = Alloc(kActs, T_ * h_ * e_);
        break;
      case ModuleNode::Role::kBlock: {
        const int b = w_.nodes[node].block;
        const Id y = BlockForward(ac ? nullptr : &caches_[b]);
        if (w_.config.checkpointing == Checkpointing::kSelective) Free(std::exchange(caches_[b].probs, -1));
        inputs_[b] = x_;
        x_ = y;
        break;
      }
      case ModuleNode::Role::kFinalNorm:
        inv_ = Alloc(kActs, T_ * 4);
        normed_ = Alloc(kActs, T_ * h_ * e_);
        break;
      case ModuleNode::Role::kLmHead: logits_ = Alloc(kActs, T_ * w_.model.vocab_size * e_); break;
      case ModuleNode::Role::kOther: break;
    }
  }

  void Backward(int node) {
    switch (w_.nodes[node].role) {
      case ModuleNode::Role::kLmHead:
        EnsureGrad(node);
        d_normed_ = Alloc(kTemp, T_ * h_ * e_);
        FreeAll({logits_, normed_});
        break;
      case ModuleNode::Role::kFinalNorm: {
        EnsureGrad(node);
        const Id dx = Alloc(kActs, T_ * h_ * e_);
        FreeAll({d_normed_, inv_, x_});
        x_ = dx;
        break;
      }
      case ModuleNode::Role::kBlock: {
        const int b = w_.nodes[node].block;
        EnsureGrad(node);
        if (w_.config.checkpointing == Checkpointing::kFull) Free(BlockForward(&caches_[b]));
        if (w_.config.checkpointing == Checkpointing::kSelective) caches_[b].probs = Alloc(kActs, scores_ * e_);
        x_ = BlockBackward(x_, caches_[b]);
        Free(inputs_[b]);
        break;
      }
      case ModuleNode::Role::kEmbedding:
        EnsureGrad(node);
        Free(std::exchange(x_, -1));
        break;
      case ModuleNode::Role::kOther: break;
    }
  }

  EventsPass events_pass_;
  const Workload& w_;
  Schedule schedule_;
  int64_t e_ = 2, T_ = 0, h_ = 0, qd_ = 0, kvd_ = 0, I_ = 0, scores_ = 0;
  std::vector<Id> full_, grad_, shard_grad_, inputs_;
  std::vector<Cache> caches_;
  Id x_ = -1, inv_ = -1, normed_ = -1, logits_ = -1, d_normed_ = -1;
  std::vector<std::pair<Cat, int64_t>> sizes_;
  CategoryBytes live_{};
  int64_t allocated_ = 0;
  PhaseTracker phases_;
  Phase peak_phase_{StepPhase::kInitialisation};
  GpuRuntimeMemory result_;
  CountingDeviceMemory device_;  // no limit: what the engine reserves on a card that never runs out
  CachingAllocator policy_;      // the engine's own policy, configured by --alloc-conf as the engine is
  std::vector<CachingAllocator::Handle> handles_;  // per Id
  std::vector<CachingAllocator::Handle> pending_;  // freed blocks awaiting another stream's event
};

}  // namespace

GpuRuntimeMemory EstimateGpuRuntimeMemory(const Workload& workload) {
  GpuRuntimeMemory m = GpuRuntimePlayer(workload, GpuRuntimePlayer::EventsPass::kNextAllocation).Play();
  m.reserved_peak_lagging_bytes = GpuRuntimePlayer(workload, GpuRuntimePlayer::EventsPass::kEndOfStep).Play().reserved_peak_bytes;
  return m;
}

}  // namespace fsdp
