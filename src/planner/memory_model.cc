#include "planner/memory_model.h"

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <algorithm>
#include <deque>
#include <memory>
#include <numeric>
#include <utility>

#include <fmt/format.h>

#include "core/lora.h"
#include "core/schedule.h"
#include "planner/activation_model.h"
#include "planner/memory_tracker.h"

namespace fsdp {
namespace {

using Cat = MemCategory;
using Pool = MemoryTracker::Pool;

// NCCL's default per-connection buffers (src/include/collectives.h / device.h, NCCL 2.18+):
// Simple 4 MiB (NCCL_BUFFSIZE), LL128 120*640*8*8 B, LL 8*512*8*16 B.
constexpr int64_t kNcclSimpleBufferBytes = 4 * 1024 * 1024;
constexpr int64_t kNcclLl128BufferBytes = 120 * 640 * 8 * 8;
constexpr int64_t kNcclLlBufferBytes = 8 * 512 * 8 * 16;
// Channels NCCL typically opens on an NVLink node, counted twice (ring + tree connections).
constexpr int64_t kNcclChannels = 16;
constexpr int64_t kNcclConnectionsPerChannel = 2;
// PyTorch CublasHandlePool.cpp _getDefaultWorkspaceSize(): 4096*8*1024 on compute capability 9.x
// and newer (Hopper, Blackwell), 4096*1024*2 + 16*1024*8 before; ROCm 32 MiB, 128 MiB on gfx94x.
// One workspace per (handle, stream): the forward thread and autograd's backward thread each get
// one, plus a 1 MiB cuBLASLt workspace each (getCUDABlasLtWorkspace).
constexpr int64_t kCublasWorkspaceSm90 = 4096 * 8 * 1024;
constexpr int64_t kCublasWorkspaceOlder = 4096 * 1024 * 2 + 16 * 1024 * 8;
constexpr int64_t kHipblasWorkspaceGfx94x = 128 * 1024 * 1024;
constexpr int64_t kCublasLtWorkspace = 1024 * 1024;
constexpr int64_t kBlasThreads = 2;

// Plays one optimizer step's schedule through a MemoryTracker: the allocations and frees each
// action makes in PyTorch FSDP (docs/memory-model.md gives each and its source).
class StepPlayer {
 public:
  StepPlayer(const Workload& w, const Schedule& schedule, MemoryTracker& mem, bool skip_repeats)
      : w_(w), c_(w.config), schedule_(schedule), mem_(mem), skip_repeats_(skip_repeats), profiles_(BlockProfilesOf(w.model, w.config)),
        head_(HeadActivationProfile(w.model, w.config)), phases_(w) {
    const size_t n = w.units.size();
    unsharded_.assign(n, {});
    unit_grad_pieces_.assign(n, {});
    for (const WrapUnit& u : w.units) {  // a sharded gradient per unit, or per hook site of a group
      site_slot_.push_back(static_cast<int>(sharded_grad_.size()));
      sharded_grad_.resize(sharded_grad_.size() + static_cast<size_t>(u.HookSites()), kNoBlock);
    }
    kept_grad_.assign(n, {});
    reduce_grad_.assign(n, {});
    node_saved_.assign(w.nodes.size(), {});
    if (w.model.tie_word_embeddings) embedding_node_ = w.EmbeddingNode();
    for (int b = 0; b < w.model.num_layers; ++b) {
      int& holder = mask_holder_[w.model.WindowOf(b) > 0 ? 1 : 0];
      if (holder < 0 && BlockCheckpointed(c_, b)) holder = b;
      if (holder == kNoMask) holder = kUnheldMask;
    }
    pb_ = BytesPerElement(c_.param_dtype);
    stream_carried_ = ResidualStreamCarried(w.model, c_);
    post_mlp_norm_ = w.model.arch.norm_placement != NormPlacement::kPre;
    if (ResidualStreamApart(w.model, c_) || stream_carried_) hidden_bytes_ = pb_ * c_.micro_batch * c_.seq_len * w.model.hidden_size;
    rb_ = BytesPerElement(c_.reduce_dtype);
    mb_ = BytesPerElement(c_.master_dtype);
    for (int b = 0; b < w.model.num_layers; ++b) {
      for (const ParamOp& op : w.model.arch.BlockOf(b)) {
        const Nf4Transient t = Nf4DequantTransient(op);
        if (t.weight_bytes + t.cast_bytes > nf4_.weight_bytes + nf4_.cast_bytes) nf4_ = t;
      }
    }
  }

  /// Plays the steps: with the caching allocator two of them (the first creates the optimizer
  /// states, as Adam does lazily at its first step(), and leaves the segments the second reuses),
  /// the peaks taken over the second; without it one step entered at steady state.
  void Play(CategoryBytes& host, const std::vector<int64_t>& cublas_workspace_blocks) {
    const bool first_step_too = mem_.allocator() != nullptr;
    phases_.Enter(StepPhase::kStart);
    mem_.SetPhase(phases_.phase());
    AllocShardedState(host, /*optimizer_states=*/!first_step_too);
    for (int64_t bytes : cublas_workspace_blocks) mem_.Alloc(Cat::kFramework, bytes);
    if (first_step_too) {
      states_allocated_ = false;
      PlayMicroBatches();
      phases_.StartStep();
      phases_.Enter(StepPhase::kStart);
      mem_.SetPhase(phases_.phase());
      mem_.ResetPeaks();
    } else if (c_.loop_holds_outputs) {
      // A loop that keeps `outputs` enters the step holding the previous micro-batch's logits.
      held_logits_ = mem_.Alloc(Cat::kActivations, head_.logits_bytes);
      for (const auto& node : w_.nodes) {
        if (node.role != ModuleNode::Role::kBlock) continue;
        for (const auto& t : profiles_.Of(node.block).cache) held_cache_.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
      }
    }
    PlayMicroBatches();
  }

  /// The caching allocator's retries (num_alloc_retries) in the micro-batches Play skipped.
  int64_t skipped_retries() const { return skipped_retries_; }

 private:
  // Sharded parameters (FSDP1: one flat shard per unit; FSDP2: one shard per parameter) and, at
  // steady state, the optimizer states; under CPU offload all of it lives in host memory.
  void AllocShardedState(CategoryBytes& host, bool optimizer_states) {
    const int64_t trainable_elems = w_.GradShardNumelTotal();
    AllocQuantStates();
    for (int64_t bytes : ModelBuffers(w_.model, c_)) mem_.Alloc(Cat::kShardedParams, bytes);  // on the device whole, offload or not
    if (c_.cpu_offload) {
      host[static_cast<int>(Cat::kShardedParams)] = ShardBytesTotal();
      host[static_cast<int>(Cat::kGradients)] = trainable_elems * mb_;
      const std::vector<int64_t> states = StateShardNumels();
      host[static_cast<int>(Cat::kOptimizerStates)] =
          OptimizerStateBytesPerParam(c_.optimizer, c_.master_dtype) * std::accumulate(states.begin(), states.end(), int64_t{0});
      return;
    }
    for (const auto& u : w_.units) {
      if (Fsdp2()) {
        for (int t : u.tensors) {
          mem_.Alloc(Cat::kShardedParams, Fsdp2ShardNumel(w_.model.tensors[t], w_.shard_world) * BytesPerElement(StorageDtype(c_, w_.model.tensors[t])));
        }
      } else {
        mem_.Alloc(Cat::kShardedParams, u.shard_bytes);
      }
    }
    if (optimizer_states) AllocOptimizerStates();
  }

  // bitsandbytes 0.50's dequantize-then-linear (backends/cuda/ops.py _dequant_linear_fallback, and
  // MatMul4Bit.backward's dequantize_4bit): the weight in the compute dtype (bnb_4bit_compute_dtype)
  // and, double-quantized, the absmax dequantized to fp32 and offset (two fp32 tensors of a block
  // each). With a compute dtype other than the param dtype, Linear4bit.forward's x.to(compute_dtype)
  // (T x in) and the product (T x out) before its cast back are alive beside it, as are the
  // gradient's casts in backward (nn/modules.py Linear4bit.forward; neither is saved: MatMul4Bit
  // keeps only the packed weight). Its fused gemm_4bit kernel, taken for micro-batches of at most
  // 1,536 tokens on some GPUs, has no dequantized weight: the unfused path is an upper bound there.
  struct Nf4Transient {
    int64_t weight_bytes = 0;  // the dequantized weight (and absmax): unsharded_params
    int64_t cast_bytes = 0;    // the input and output in the compute dtype: activations
  };
  Nf4Transient Nf4DequantTransient(const ParamOp& op) const {
    if (op.nf4_storage_bytes == 0) return {};
    const int64_t n = op.in * op.out, blocks = (n + 63) / 64;
    const DType compute = QloraComputeDtype(c_);
    return {n * BytesPerElement(compute) + (c_.lora.double_quant ? 2 * 4 * blocks : 0),
            compute == c_.param_dtype ? 0 : w_.TokensPerMicroBatch() * (op.in + op.out) * BytesPerElement(compute)};
  }

  int64_t ShardBytesTotal() const {
    int64_t total = 0;
    for (const auto& u : w_.units) total += u.shard_bytes;
    return total;
  }

  // QLoRA: the quantization state of every NF4 weight, whole on each rank and on the GPU (it lives
  // on the module, outside FSDP's flat or sharded parameters, so CPU offload leaves it there): the
  // tensors of bitsandbytes' QuantState, each an allocation of its own.
  void AllocQuantStates() {
    for (const TensorSpec& t : w_.model.tensors) {
      if (t.nf4_numel == 0) continue;
      for (int64_t bytes : Nf4QuantStateTensorBytes(t.nf4_numel, c_.lora.double_quant)) mem_.Alloc(Cat::kShardedParams, bytes);
    }
  }

  // The optimizer's per-parameter states in the order Adam's _init_group creates them (exp_avg then
  // exp_avg_sq of each parameter), and the shard each one has: FSDP1 a unit's flat gradient shard,
  // FSDP2 each trainable parameter's.
  std::vector<int64_t> StateShardNumels() const {
    if (Fsdp2()) return Fsdp2StateShardNumels();
    std::vector<int64_t> numels;
    const int64_t rank = OrigParamStateRank();
    for (const auto& u : w_.units) {
      if (u.grad_shard_numel == 0) continue;
      if (u.trainable_numel != u.numel) {
        // use_orig_params with frozen parameters: the optimizer holds the trainable original
        // parameters, each a view of its part of this rank's flat shard (FlatParamHandle's
        // _use_sharded_views), so it has states for those parts only
        for (const auto& [t, numel] : TrainableShardParts(u, rank)) numels.push_back(numel);
        continue;
      }
      numels.push_back(u.grad_shard_numel);
    }
    return numels;
  }

  // FSDP2 leaves the parameters in the model, so the optimizer (AdamW(model.parameters())) holds
  // them in the model's order, not the units': the embedding's states first, the head's last.
  std::vector<int64_t> Fsdp2StateShardNumels() const {
    std::vector<bool> sharded(w_.model.tensors.size(), false);
    for (const auto& u : w_.units) {
      if (u.grad_shard_numel == 0) continue;
      for (int t : u.tensors) sharded[static_cast<size_t>(t)] = true;
    }
    std::vector<int64_t> numels;
    for (size_t t = 0; t < w_.model.tensors.size(); ++t) {
      if (sharded[t] && w_.model.tensors[t].trainable) numels.push_back(Fsdp2ShardNumel(w_.model.tensors[t], w_.shard_world));
    }
    return numels;
  }

  // FSDP1: the parts of a mixed unit's trainable parameters that fall in `rank`'s shard, as
  // (tensor, elements), the empty parts left out.
  std::vector<std::pair<int, int64_t>> TrainableShardParts(const WrapUnit& u, int64_t rank) const {
    const std::vector<int64_t> starts = Fsdp1FlatOffsets(w_.model, u.tensors, c_);
    const int64_t lo = rank * u.shard_numel, hi = lo + u.shard_numel;
    std::vector<std::pair<int, int64_t>> parts;
    for (size_t i = 0; i < u.tensors.size(); ++i) {
      const TensorSpec& t = w_.model.tensors[u.tensors[i]];
      const int64_t part = std::min(hi, starts[i] + t.numel()) - std::max(lo, starts[i]);
      if (t.trainable && part > 0) parts.emplace_back(u.tensors[i], part);
    }
    return parts;
  }

  // The rank whose shards hold the most trainable elements of FSDP1's mixed units (the one that
  // needs the most optimizer states; ranks differ only there). 0 when no unit is mixed.
  int64_t OrigParamStateRank() const {
    std::vector<int64_t> per_rank;
    for (const auto& u : w_.units) {
      if (u.trainable_numel == 0 || u.trainable_numel == u.numel || u.shard_numel == 0) continue;
      per_rank.resize(static_cast<size_t>(w_.shard_world), 0);
      const std::vector<int64_t> starts = Fsdp1FlatOffsets(w_.model, u.tensors, c_);
      for (size_t i = 0; i < u.tensors.size(); ++i) {
        const TensorSpec& t = w_.model.tensors[u.tensors[i]];
        if (!t.trainable) continue;
        const int64_t end = starts[i] + t.numel();
        for (int64_t r = starts[i] / u.shard_numel; r < w_.shard_world && r * u.shard_numel < end; ++r) {
          per_rank[r] += std::min(end, (r + 1) * u.shard_numel) - std::max(starts[i], r * u.shard_numel);
        }
      }
    }
    return per_rank.empty() ? 0 : std::max_element(per_rank.begin(), per_rank.end()) - per_rank.begin();
  }

  void AllocOptimizerStates() {
    const int states = OptimizerStateCount(c_.optimizer);
    for (int64_t numel : StateShardNumels()) {
      for (int s = 0; s < states; ++s) mem_.Alloc(Cat::kOptimizerStates, numel * mb_);
    }
    states_allocated_ = true;
  }

  // Micro-batches that run the same program from the same state repeat what they did byte for
  // byte. Once a micro-batch ends in the state one of the last kMaxCyclePeriod ended in (period 1:
  // the previous one's, as in most replays; longer when the caching allocator frees its cache and
  // retries in every micro-batch and its segments cycle), the whole cycles before the last
  // micro-batch are skipped: their peaks equal those already played, which the tracker has, and
  // their allocator retries are counted (skipped_retries_). So 10^6 micro-batches cost a few.
  // With the caching allocator the state includes its segment layout.
  struct MicroBatchEnd {
    int64_t micro = 0, retries = 0;
    CategoryBytes bytes{};
    std::vector<size_t> pending;
    std::vector<SegmentView> layout;
    bool SameState(const MicroBatchEnd& o) const { return bytes == o.bytes && pending == o.pending && layout == o.layout; }
  };
  static constexpr int64_t kMaxCyclePeriod = 16;
  bool SameProgram(int64_t from, int64_t to) const {
    for (int64_t m = from; m < to; ++m) {
      if (schedule_.ProgramOf(m) != schedule_.ProgramOf(to)) return false;
    }
    return true;
  }

  void PlayMicroBatches() {
    const int64_t last = c_.grad_accum - 1;
    std::deque<MicroBatchEnd> recent;  // the last kMaxCyclePeriod micro-batches' ends, oldest first
    for (int64_t micro = 0; micro <= last; ++micro) {
      phases_.StartMicroBatch(static_cast<int>(micro));
      for (const Action& a : schedule_.MicroBatch(micro)) Play(a);
      // (only an accumulation of four or more can skip: from micro-batch 1 to the one before the last)
      MicroBatchEnd end{micro, mem_.allocator() ? mem_.allocator()->stats().num_alloc_retries : 0, mem_.DeviceNow(), mem_.PendingCounts(),
                        mem_.allocator() && last >= 3 ? mem_.allocator()->Snapshot() : std::vector<SegmentView>{}};
      if (skip_repeats_ && micro >= 1 && micro + 1 < last && schedule_.ProgramOf(micro + 1) == schedule_.ProgramOf(micro)) {
        for (const MicroBatchEnd& before : recent) {
          if (before.micro < 1 || !before.SameState(end) || !SameProgram(before.micro, micro)) continue;
          const int64_t period = micro - before.micro, cycles = (last - 1 - micro) / period;
          skipped_retries_ += cycles * (end.retries - before.retries);
          micro += cycles * period;
          end.micro = micro;
          recent.clear();  // (retries are counted from played micro-batches only)
          break;
        }
      }
      recent.push_back(std::move(end));
      if (static_cast<int64_t>(recent.size()) > kMaxCyclePeriod) recent.pop_front();
    }
  }

  // The phase each action opens, except the end of the forward's: after its free.
  void Play(const Action& a) {
    if (a.kind != ActionKind::kEndForward) {
      phases_.Enter(a);
      mem_.SetPhase(phases_.phase());
    }
    switch (a.kind) {
      case ActionKind::kPreForward:
      case ActionKind::kPreBackward: break;
      case ActionKind::kUnshard: Unshard(a); break;
      case ActionKind::kWaitUnshard: WaitUnshard(a.unit); break;
      case ActionKind::kForward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) ForwardVisit(v.node);
        break;
      case ActionKind::kBackward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) BackwardVisit(v);
        break;
      case ActionKind::kPostForward: break;  // the reshard that may follow frees under the unit's own phase
      case ActionKind::kReshard: Reshard(a); break;
      case ActionKind::kEndForward:
        if (a.releases_all_gather_state) mem_.Free(fsdp2_deferred_);  // the root's post-forward drops the held all-gather output
        phases_.Enter(a);
        mem_.SetPhase(phases_.phase());
        break;
      case ActionKind::kPostBackward: PostBackward(a); break;
      case ActionKind::kReduce: Reduce(a.unit, a.site); break;
      case ActionKind::kEndBackward:
        mem_.Free(fsdp2_rs_deferred_);
        mem_.Free(fsdp2_deferred_);
        for (BlockId& b : reentrant_held_) mem_.Free(b);  // _finalize_params removes the hooks
        reentrant_held_.clear();
        reentrant_above_grad_bytes_ = 0;
        mem_.ReleaseAllPending();
        break;
      case ActionKind::kOptimizer: OptimizerStep(); break;
    }
  }

  bool Fsdp2() const { return c_.framework == Framework::kFsdp2; }
  bool Sharded() const { return c_.strategy != Strategy::kNoShard; }
  bool Fsdp2WorldOfOne() const { return Fsdp2() && w_.shard_world == 1; }

  // ---- unshard / reshard -------------------------------------------------------------------
  void Unshard(const Action& a) {
    const int u = a.unit;
    const WrapUnit& unit = w_.units[u];
    if (Fsdp2WorldOfOne()) return;  // no all-gather: the copy-out casts the shards (WaitUnshard)
    if (!Sharded()) {
      // NO_SHARD: the "unsharded" parameter is the full-size low-precision copy (_mp_shard),
      // made on the pre-unshard stream; its reshards' frees wait for the compute stream
      // (Reshard). NO_SHARD has no rate limiter; how far the GPU trails the host is a question of
      // time, taken here as one unit, the rate limiter's rule: every copy but the newest has been
      // passed by the next unshard. (The H200's NO_SHARD runs held that and, on TinyLlama, one
      // block's copy more: docs/accuracy.md.)
      mem_.ReleaseAllButNewest(Pool::kAllGather);
      if (unit.casts_for_compute || c_.cpu_offload) unsharded_[u] = {mem_.Alloc(Cat::kUnshardedParams, unit.numel * pb_, Stream::kPreUnshard)};
      return;
    }
    // FSDP2's all_gather_copy_in writes the input into a view of the output (no buffer of its own),
    // on its all-gather copy-in stream, through an fp32 device copy of an offloaded shard.
    BlockId input = kNoBlock;
    if (Fsdp2()) {
      BlockId staging = c_.cpu_offload ? mem_.Alloc(Cat::kCommBuffers, unit.shard_bytes, Stream::kUnshard) : kNoBlock;
      mem_.Free(staging);
    } else {
      input = Fsdp1AllGatherInput(unit);
    }
    if (a.rate_limited) {
      // Under the rate limiter the CPU issues an all-gather only once the GPU has passed the
      // reshards queued before it (_limiter_utils): taken here as every freed buffer but the newest
      // being reusable by then. (The schedule's queue says when the CPU waits; which freed buffers
      // the GPU has really passed is a question of GPU time, for fsdp-sim.)
      mem_.ReleaseAllButNewest(Pool::kAllGather);
    }
    if (Fsdp2()) {
      BlockId flat = mem_.Alloc(Cat::kCommBuffers, unit.padded_numel * pb_, Stream::kUnshard);
      if (fsdp2_deferred_ != kNoBlock && a.forward) mem_.Free(fsdp2_deferred_);
      unsharded_[u].clear();
      for (int t : unit.tensors) unsharded_[u].push_back(mem_.Alloc(Cat::kUnshardedParams, Fsdp2UnshardedNumel(t) * pb_));
      if (a.forward) fsdp2_deferred_ = flat; else mem_.Free(flat);
      return;
    }
    unsharded_[u] = {mem_.Alloc(Cat::kUnshardedParams, unit.padded_numel * pb_, Stream::kUnshard)};
    mem_.FreeToPending(input, Pool::kAllGatherInput);
  }

  // FSDP1's all-gather input, made on the pre-unshard stream (kNoBlock where the all-gather reads
  // the shard itself): _use_low_precision_shard allocates _mp_shard, then the offloaded shard's fp32
  // device copy its copy_ casts (gone at the statement's end); offloaded without casts, that copy
  // (pre_unshard's flat_param_to) is the input. FSDP1 record_stream()s the input to the unshard
  // stream before dropping it (post_unshard -> _free_low_precision_sharded_param for _mp_shard;
  // _all_gather_flat_param for an offloaded copy), so its block is back in the pre-unshard
  // stream's pool only once the GPU has passed the all-gather (Unshard frees it to that pending
  // pool). When is a question of GPU time, taken here as one unit: every input but the newest has
  // been passed by the next unshard (under the rate limiter its synchronisation guarantees only
  // the one before), so a backward prefetch, which unshards two units back to back, holds two.
  // Without the limiter too: an input waits for its all-gather only, which the unshard stream
  // runs as soon as it is issued (it waits for the compute stream only at the root's pre-forward,
  // _wait_for_computation_stream), unlike a flat parameter, which waits for its unit's compute
  // and which Unshard then holds to the backward's end. (A run bound by its all-gathers could hold
  // more.)
  BlockId Fsdp1AllGatherInput(const WrapUnit& unit) {
    mem_.ReleaseAllButNewest(Pool::kAllGatherInput);
    BlockId input = unit.casts_for_compute ? mem_.Alloc(Cat::kCommBuffers, unit.shard_numel * pb_, Stream::kPreUnshard) : kNoBlock;
    BlockId staging = c_.cpu_offload ? mem_.Alloc(Cat::kCommBuffers, unit.shard_bytes, Stream::kPreUnshard) : kNoBlock;
    if (input == kNoBlock) return staging;
    mem_.Free(staging);
    return input;
  }

  // FSDP2's unsharded parameters are one storage per parameter (FSDPParam.all_gather_outputs,
  // each alloc_storage'd by foreach_all_gather_copy_out in the group's parameter order, freed in
  // the same order by free_unsharded_param), of its dim-0 padded shard times the world.
  int64_t Fsdp2UnshardedNumel(int tensor) const { return Fsdp2ShardNumel(w_.model.tensors[tensor], w_.shard_world) * w_.shard_world; }

  // FSDP2 on a shard group of one (_fsdp_param_group.py wait_for_unshard, world_size == 1): no
  // all-gather and no flat output; when the unit itself runs, each parameter in turn has its
  // all-gather input made (the shard cast to param_dtype: a new tensor when the dtypes differ) and
  // its unsharded storage allocated and copied into. The loop's variable holds each input until the
  // next one replaces it, the last until the hook returns. A prefetch therefore holds nothing, and
  // nothing is kept for the next copy-out.
  void WaitUnshard(int u) {
    if (!Fsdp2WorldOfOne()) return;
    BlockId input = kNoBlock;
    unsharded_[u].clear();
    for (int t : w_.units[u].tensors) {
      const TensorSpec& tensor = w_.model.tensors[t];
      BlockId next = StorageDtype(c_, tensor) != c_.param_dtype ? mem_.Alloc(Cat::kCommBuffers, tensor.numel() * pb_) : kNoBlock;
      mem_.Free(input);
      input = next;
      unsharded_[u].push_back(mem_.Alloc(Cat::kUnshardedParams, Fsdp2UnshardedNumel(t) * pb_));
    }
    mem_.Free(input);
  }

  // FSDP1 record_stream()s the unsharded flat parameter to the compute stream before freeing it
  // (_free_unsharded_flat_param), and under NO_SHARD the low-precision copy that stands for it
  // (post_reshard -> _free_low_precision_sharded_param): the caching allocator holds the block
  // until the GPU has passed that moment. NO_SHARD's copy of an offloaded parameter without
  // parameter mixed precision (pre_unshard's flat_param_to) is dropped with no record_stream.
  void Reshard(const Action& a) {
    std::vector<BlockId>& buffers = unsharded_[a.unit];
    if (Fsdp2() || (!Sharded() && !w_.units[a.unit].casts_for_compute)) {
      FreeAll(buffers);
      return;
    }
    for (BlockId& buffer : buffers) mem_.FreeToPending(buffer, Pool::kAllGather);
    buffers.clear();
  }

  // ---- forward -----------------------------------------------------------------------------
  void ForwardVisit(int node_id) {
    if (phases_.Enter(NodeVisit{node_id, false}, true)) mem_.SetPhase(phases_.phase());
    ForwardActivations(node_id);
  }

  // A checkpointed block's forward still makes what it does not keep: the tensors its backward
  // recomputes exist while the block runs and are gone at its end. What matters to the caching
  // allocator is that their segments exist before the head's logits are allocated: on the H200,
  // PyTorch's allocator history showed a checkpointed Llama's forward leaving 512 MiB segments
  // that the recomputation, and later AdamW's states, reuse, where a replay without them carved
  // both out of the logits' segments (+19% reserved). They are handed out on the allocator only,
  // one sub-layer at a time: under no_grad nothing the attention sub-layer makes outlives it but
  // its output (added into the residual stream), so its tensors are taken back before the MLP's
  // are made (SavedTensor::mlp_sublayer). PyTorch frees them one by one as the forward goes, so
  // holding a sub-layer's together in the tensors' accounting could put a forward above the peak
  // it has.
  void ForwardIntermediates(const std::vector<SavedTensor>& tensors) {
    for (bool mlp : {false, true}) {
      std::vector<int64_t> bytes;
      bytes.reserve(tensors.size());
      for (const auto& t : tensors) {  // (the reentrant recomputation's output is the next block's input here)
        if (t.mlp_sublayer == mlp && t.name != "checkpoint.reentrant_output") bytes.push_back(t.bytes);
      }
      mem_.AllocatorOnly(bytes);
    }
  }

  // BlockActivations::forward_moment: its tensors at once, then gone (after the block's batch of
  // intermediates, whose freed segments they mostly reuse)
  void ForwardMoment(const std::vector<SavedTensor>& tensors) {
    std::vector<BlockId> live;
    live.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      live.push_back(mem_.Alloc(Cat::kActivations, tensors[i].bytes));
      if (i > 0 && tensors[i - 1].freed_by_next_in_moment) mem_.Free(live[i - 1]);
    }
    for (BlockId& b : live) mem_.Free(b);
  }

  void AllocSaved(int node_id, const std::vector<SavedTensor>& tensors) {
    TransientsBetween between(mem_);
    for (const auto& t : tensors) node_saved_[node_id].push_back(between.Alloc(t));
  }
  // a block's kept tensors made before its eager core's forward moment (the first call, which
  // sizes the block's list), or after it: node_saved_ stays indexed as `tensors`; the block's
  // transients (`between`) live through both calls and its output
  void AllocSaved(int node_id, const std::vector<SavedTensor>& tensors, bool after_forward_moment, TransientsBetween& between) {
    std::vector<BlockId>& saved = node_saved_[node_id];
    if (!after_forward_moment) saved.assign(tensors.size(), kNoBlock);
    size_t first = 0;
    if (stream_carried_ && !after_forward_moment && !tensors.empty() && tensors.front().name == "block.input") {
      std::swap(saved.front(), stream_);  // made already: the previous block's output
      first = 1;
    }
    for (size_t i = first; i < tensors.size() && i < saved.size(); ++i) {
      if (tensors[i].after_forward_moment == after_forward_moment) saved[i] = between.Alloc(tensors[i]);
    }
  }

  // The block's last transient, freed as it returns with its others: down's output (pre-norm) or
  // the post-MLP norm's (Gemma's sandwich, OLMo 2: made after the frees due, as is the output:
  // MarkPostNormTransients); then its sum with the residual, the block's output. The hidden states
  // the block read go once it has returned, unless they are inputs_embeds (ResidualStreamApart) or
  // the block's list took them (ResidualStreamCarried)
  void BlockOutput(TransientsBetween& between) {
    between.AllocTransient(hidden_bytes_);
    const BlockId output = post_mlp_norm_ ? between.Alloc(SavedTensor{"block.output", hidden_bytes_}) : mem_.Alloc(Cat::kActivations, hidden_bytes_);
    if (stream_ != embedded_) mem_.Free(stream_);  // (carried: none, the block's list took it)
    stream_ = output;
  }

  void ForwardActivations(int node_id) {
    const ModuleNode& node = w_.nodes[node_id];
    switch (node.role) {
      case ModuleNode::Role::kEmbedding:
        AllocSaved(node_id, head_.embedding);
        if (stream_carried_) stream_ = mem_.Alloc(Cat::kActivations, hidden_bytes_);
        else if (hidden_bytes_ > 0) stream_ = embedded_ = mem_.Alloc(Cat::kActivations, hidden_bytes_);
        if (c_.attention == Attention::kEager) {
          // HF builds a 4D causal mask [B, 1, s, s] in the compute dtype for eager attention, freed
          // after the last block's forward; any checkpointing keeps it (an input of every
          // checkpointed block or attention function, held for the recomputation) until the
          // embedding's backward, as a saved tensor: under --ac full, PyTorch's tensors at the peak
          // held exactly this 4,194,304 bytes (2 x 1024 x 1024 x bf16) more than fsdp-plan counted.
          // A model with sliding-window and full-attention layers builds one of each
          // (causal_mask_mapping in Gemma 2/3, gpt-oss, Qwen3, Llama 4's chunks): a checkpointed
          // block holds its kind's until its backward has run (tools/peak_trace.py: gemma2-100m and
          // gpt-oss-tiny hold both inside block 1's backward, llama4-text-tiny only the chunked one,
          // its full layer 3 done).
          for (int kind = 0; kind < 2; ++kind) {
            if (mask_holder_[kind] != kNoMask) masks_[kind] = mem_.Alloc(Cat::kActivations, pb_ * c_.micro_batch * c_.seq_len * c_.seq_len);
          }
        }
        break;
      case ModuleNode::Role::kBlock: {
        TransientsBetween between(mem_);
        AllocSaved(node_id, BlockProfile(node_id).kept, false, between);
        if (BlockCheckpointed(c_, w_.nodes[node_id].block)) ForwardIntermediates(BlockProfile(node_id).recomputed);
        for (const auto& t : BlockProfile(node_id).cache) cache_.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
        ForwardMoment(BlockProfile(node_id).forward_moment);
        AllocSaved(node_id, BlockProfile(node_id).kept, true, between);
        ForwardMoment(BlockProfile(node_id).experts_forward_moment);
        // QLoRA: each weight is dequantized for its product and dropped after: the largest, taken
        // with all the block's saved tensors alive (an upper bound by the ones saved after it)
        if (nf4_.weight_bytes > 0) {
          BlockId dequantized = mem_.Alloc(Cat::kUnshardedParams, nf4_.weight_bytes);
          BlockId casts = nf4_.cast_bytes > 0 ? mem_.Alloc(Cat::kActivations, nf4_.cast_bytes) : kNoBlock;
          mem_.Free(casts);
          mem_.Free(dequantized);
        }
        if (hidden_bytes_ > 0) BlockOutput(between);
        break;
      }
      case ModuleNode::Role::kFinalNorm:
        AllocSaved(node_id, head_.final_norm);
        // the decoder returns: its last output and inputs_embeds go
        if (stream_ != embedded_) mem_.Free(stream_);
        mem_.Free(embedded_);
        stream_ = kNoBlock;
        for (int kind = 0; kind < 2; ++kind) {
          if (mask_holder_[kind] == kUnheldMask) mem_.Free(masks_[kind]);  // no checkpointed block reads it again
        }
        break;
      case ModuleNode::Role::kLmHead: {
        BlockId logits = kNoBlock, upcast = kNoBlock;
        if (head_.upcast_in_model) {  // `logits = logits.float()` in the model: lm_head's output dies there
          BlockId output = mem_.Alloc(Cat::kActivations, head_.loss_forward_transient_bytes);
          logits = mem_.Alloc(Cat::kActivations, head_.logits_bytes);
          mem_.Free(output);
        } else {
          logits = mem_.Alloc(Cat::kActivations, head_.logits_bytes);
          upcast = mem_.Alloc(Cat::kActivations, head_.loss_forward_transient_bytes);
        }
        BlockId shifted = mem_.Alloc(Cat::kActivations, head_.shift_copy_bytes);
        node_saved_[node_id].push_back(mem_.Alloc(Cat::kActivations, head_.loss_saved_bytes));
        mem_.Free(shifted);  // the loss's locals die as it returns
        mem_.Free(upcast);
        if (c_.loop_holds_outputs) {
          // `outputs = model(...)` rebinds once the forward (and HF's loss inside it) has returned:
          // the previous output's logits (and past_key_values) die then, these live until the next rebinding.
          mem_.Free(held_logits_);
          held_logits_ = logits;
          for (BlockId b : held_cache_) mem_.Free(b);
          held_cache_ = std::move(cache_);
        } else {
          mem_.Free(logits);  // Trainer, Lightning and torchtitan keep only the loss
          for (BlockId b : cache_) mem_.Free(b);
        }
        cache_.clear();
        break;
      }
      case ModuleNode::Role::kOther: break;
    }
  }

  // ---- backward ----------------------------------------------------------------------------
  // A node's own backward (recomputation, gradient working memory, the loss's buffers) when it is
  // entered; its parameters' gradients once its children are done.
  void BackwardVisit(const NodeVisit& v) {
    const ModuleNode& node = w_.nodes[v.node];
    if (phases_.Enter(v, false)) mem_.SetPhase(phases_.phase());
    if (v.enter) {  // enters and exits nest: the node's transients sit on top of the stack until its exit
      transient_starts_.push_back(transients_.size());
      BackwardActivations(v.node);
      return;
    }
    if (node.role == ModuleNode::Role::kLmHead && node.tensors.empty() && embedding_node_ >= 0) {
      AllocGradients(embedding_node_);  // tied: AccumulateGrad sets the embedding weight's .grad here
    } else if (v.node == embedding_node_ && w_.model.tie_word_embeddings) {
      for (int t : node.tensors) {  // embedding_dense_backward's result, added into that .grad in place
        if (!w_.model.tensors[t].trainable) continue;
        BlockId added = mem_.Alloc(Cat::kGradients, w_.model.tensors[t].numel() * pb_);
        mem_.Free(added);
      }
    } else {
      AllocGradients(v.node);
    }
    // autograd releases what the module's ops saved once their backward has run
    for (const Release& r : releases_) {
      if (r.node == v.node) mem_.Free(r.transient ? transients_[r.index] : node_saved_[r.block][r.index]);
    }
    if (v.node == mlp_moment_at_) {  // the product's backward, after down's (BlockActivations::mlp_working_bytes)
      BlockId moment = mem_.Alloc(Cat::kActivations, mlp_moment_bytes_);
      mem_.Free(moment);
      mlp_moment_at_ = -1;
    }
    if (v.node == mlp_working_until_) {
      mem_.Free(mlp_working_);
      mlp_working_until_ = -1;
    }
    // the attention core's backward follows its output projection's (or ends a block without one)
    if (softmax_block_ && (v.node == softmax_block_->output_projection || v.node == softmax_block_->node)) {
      SoftmaxBackward(*softmax_block_);
      softmax_block_.reset();
    }
    if (node.role == ModuleNode::Role::kBlock) {
      for (int kind = 0; kind < 2; ++kind) {
        if (mask_holder_[kind] == node.block) mem_.Free(masks_[kind]);
      }
    }
    for (size_t i = transient_starts_.back(); i < transients_.size(); ++i) mem_.Free(transients_[i]);
    transients_.resize(transient_starts_.back());
    transient_starts_.pop_back();
    if (node.role == ModuleNode::Role::kBlock) HoldReentrantInput(v.node);
    for (BlockId& b : node_saved_[v.node]) mem_.Free(b);
    node_saved_[v.node].clear();
  }

  // --ac-reentrant under FSDP1 (FsdpConfig::ac_reentrant): a frozen unit's reshard-only hook,
  // registered on the detached input of its reentrant recomputation, holds that input and, from
  // the next block's backward on, the gradient autograd accumulated into it (the incoming gradient
  // of the block below), until backward ends. Measured on the CPU with transformers 4.48.1 and
  // torch 2.11 (FSDP1, peft LoRA under peft's wrap, llama-100m 2k vocab, 2 x 1024): each layer's
  // recomputation starts 2 c h T higher than the last (6 MiB), where non-reentrant
  // checkpointing's starts c h T lower, after a first step of c h T.
  // Blocks run their backward from the last to the first: at block k's end the gradient of the
  // block above's input (block k's incoming gradient, needed until now) stays held if that block's
  // input is; the first block's own input gradient stays with it (the embedding's output, a leaf
  // under enable_input_require_grads, keeps it as its .grad too).
  void HoldReentrantInput(int block_node) {
    if (!ReentrantHoldsInputs(c_)) return;
    if (reentrant_above_grad_bytes_ > 0) reentrant_held_.push_back(mem_.Alloc(Cat::kActivations, reentrant_above_grad_bytes_));
    reentrant_above_grad_bytes_ = 0;
    if (!HoldsReentrantInput(block_node)) return;
    const std::vector<SavedTensor>& kept = BlockProfile(block_node).kept;
    std::vector<BlockId>& saved = node_saved_[block_node];
    for (size_t i = 0; i < kept.size() && i < saved.size(); ++i) {
      if (kept[i].name != "checkpoint.block_input" || saved[i] == kNoBlock) continue;
      reentrant_held_.push_back(saved[i]);
      saved[i] = kNoBlock;
      reentrant_above_grad_bytes_ = kept[i].bytes;  // its gradient has the input's shape
    }
    if (w_.nodes[block_node].block == 0 && reentrant_above_grad_bytes_ > 0) {
      reentrant_held_.push_back(mem_.Alloc(Cat::kActivations, reentrant_above_grad_bytes_));
      reentrant_above_grad_bytes_ = 0;
    }
  }

  // The block is an FSDP1 unit of its own whose flat parameter is frozen, and its checkpoint (run
  // around the unit) recomputes it. (Frozen units inside a block, --wrap linear, register their
  // hooks on tensors of the recomputed graph, not on its input: not modelled.)
  bool HoldsReentrantInput(int block_node) const {
    const int unit = w_.nodes[block_node].unit;
    if (unit < 0 || !BlockCheckpointed(c_, w_.nodes[block_node].block)) return false;
    for (int t : w_.units[unit].tensors) {
      if (w_.model.tensors[t].trainable) return false;
    }
    return true;
  }

  // Registers a block's saved tensors (kept, and recomputed ones on the transient stack from the
  // block's start) for release at the end of their SavedTensor::freed_after module's backward.
  void ScheduleReleases(int block_node, bool recomputed) {
    const BlockActivations& profile = BlockProfile(block_node);
    releases_.clear();  // blocks do not nest: the previous block's have all run
    std::string_view module;  // neighbours mostly share theirs (static text: one pointer per module)
    int node = -1;
    auto schedule = [&](const SavedTensor& t, bool transient, size_t index) {
      if (t.freed_after.empty()) return;
      if (t.freed_after.data() != module.data()) node = ModuleUnder(block_node, module = t.freed_after);
      if (node >= 0) releases_.push_back({node, transient, index, block_node});
    };
    for (size_t i = 0; i < profile.kept.size() && i < node_saved_[block_node].size(); ++i) schedule(profile.kept[i], false, i);
    if (!recomputed) return;
    for (size_t i = 0; i < profile.recomputed.size(); ++i) schedule(profile.recomputed[i], true, transient_starts_.back() + i);
  }

  // Whether a node's path ends in "." + `tail`.
  static bool PathEndsWith(const std::string& path, std::string_view tail) {
    return path.size() > tail.size() && path.ends_with(tail) && path[path.size() - tail.size() - 1] == '.';
  }

  // The node at `relative` (a module path inside the block: "mlp.down_proj") under a block node,
  // -1 if it has none. Blocks build their subtrees alike, so a module found once is tried at the
  // same offset from every block (checked: its path ends so and its ancestors lead to the block)
  // before the block's children are searched component by component.
  int ModuleUnder(int block_node, std::string_view relative) {
    const ReleaseOffset* cached = nullptr;
    for (const ReleaseOffset& o : release_offsets_) {
      if (o.relative.data() == relative.data() || o.relative == relative) cached = &o;
    }
    if (cached != nullptr) {
      const int node = block_node + cached->offset;
      if (node >= 0 && static_cast<size_t>(node) < w_.nodes.size() && PathEndsWith(w_.nodes[static_cast<size_t>(node)].path, relative)) {
        int up = node;
        for (int i = 0; i < cached->depth && up >= 0; ++i) up = w_.nodes[static_cast<size_t>(up)].parent;
        if (up == block_node) return node;
      }
    }
    int node = block_node;
    for (std::string_view rest = relative; node >= 0 && !rest.empty();) {
      const size_t dot = rest.find('.');
      const std::string_view part = rest.substr(0, dot);
      rest = dot == std::string_view::npos ? std::string_view() : rest.substr(dot + 1);
      int next = -1;
      for (int child : w_.nodes[static_cast<size_t>(node)].children) {
        if (PathEndsWith(w_.nodes[static_cast<size_t>(child)].path, part)) next = child;
      }
      node = next;
    }
    if (node >= 0 && cached == nullptr) {
      release_offsets_.push_back({relative, node - block_node, 1 + static_cast<int>(std::count(relative.begin(), relative.end(), '.'))});
    }
    return node;
  }

  // The saved tensors of a block: the configured checkpointing's, or none's for a block that
  // --ac-every leaves un-checkpointed.
  const BlockActivations& BlockProfile(int node_id) const { return profiles_.Of(w_.nodes[node_id].block); }


  int OwningUnit(int node_id) const {
    while (w_.nodes[node_id].unit < 0) node_id = w_.nodes[node_id].parent;
    return w_.nodes[node_id].unit;
  }

  // Recomputation, gradient working memory and loss-backward buffers of a node's own ops, pushed on
  // the transient stack.
  void BackwardActivations(int node_id) {
    std::vector<BlockId>& transient = transients_;
    switch (w_.nodes[node_id].role) {
      case ModuleNode::Role::kBlock:
        if (BlockCheckpointed(c_, w_.nodes[node_id].block)) {
          // full: the whole block runs again; selective: only the attention core; selective-op:
          // all but what it kept, after which the kept outputs only the recomputation read go
          const BlockActivations& profile = BlockProfile(node_id);
          for (const auto& t : profile.recomputed) transient.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
          ForwardMoment(profile.experts_recompute_moment);
          const std::vector<SavedTensor>& kept = profile.kept;
          for (size_t i = 0; i < kept.size(); ++i) {
            if (kept[i].freed_after_recompute) mem_.Free(node_saved_[node_id][i]);
          }
        }
        if (!BlockProfile(node_id).softmax_backward.empty()) {
          softmax_block_ = SoftmaxBlock{node_id, ModuleUnder(node_id, w_.model.arch.attention_output), transient_starts_.back(), transient.size()};
        }
        {
          // the working gradients held through the block, and the MLP's moment beyond them: right
          // after its down projection's backward, or held through the MLP's backward where routed
          // experts have no such module (BlockActivations::mlp_working_bytes)
          const BlockActivations& profile = BlockProfile(node_id);
          ScheduleReleases(node_id, BlockCheckpointed(c_, w_.nodes[node_id].block));
          for (const SavedTensor& t : profile.backward_working) transient.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
          if (const int down = ModuleUnder(node_id, w_.model.arch.mlp_output); down >= 0) {
            mlp_moment_at_ = down;
            mlp_moment_bytes_ = profile.mlp_working_bytes;
          } else {
            mlp_working_ = mem_.Alloc(Cat::kActivations, profile.mlp_working_bytes);
            const int mlp = ModuleUnder(node_id, w_.model.arch.mlp_module);
            mlp_working_until_ = mlp >= 0 ? mlp : node_id;
          }
        }
        // QLoRA: the weight dequantized again for the input gradient (MatMul4Bit.backward)
        if (nf4_.weight_bytes > 0) transient.push_back(mem_.Alloc(Cat::kUnshardedParams, nf4_.weight_bytes));
        if (nf4_.cast_bytes > 0) transient.push_back(mem_.Alloc(Cat::kActivations, nf4_.cast_bytes));
        break;
      case ModuleNode::Role::kLmHead: {
        // autograd's order (torch/csrc/autograd/engine.cpp: a node's input buffer and saved
        // tensors are released once it has run): NllLossBackward0 makes a zero-filled fp32
        // gradient, LogSoftmaxBackward0 its fp32 result, after which the first and the saved
        // log_softmax output go; ToCopyBackward0 (the .float() upcast) casts the result to the
        // logits' dtype, which lm_head's backward then reads. Two blocks, not one twice the size:
        // the caching allocator reuses the forward's freed upcast for the first.
        BlockId nll_grad = mem_.Alloc(Cat::kActivations, head_.loss_grad_bytes);
        BlockId logits_grad_fp32 = mem_.Alloc(Cat::kActivations, head_.loss_grad_bytes);
        mem_.Free(nll_grad);
        for (BlockId& b : node_saved_[node_id]) mem_.Free(b);
        node_saved_[node_id].clear();
        if (head_.slice_grad_bytes > 0) {  // before 4.49: SliceBackward0 widens the shifted rows' gradient to the logits'
          BlockId widened = mem_.Alloc(Cat::kActivations, head_.slice_grad_bytes);
          mem_.Free(logits_grad_fp32);
          logits_grad_fp32 = widened;
        }
        if (head_.loss_forward_transient_bytes > 0) {  // logits in a 16-bit dtype: the downcast gradient
          transient.push_back(mem_.Alloc(Cat::kActivations, head_.LmHeadOutputBytes()));
          mem_.Free(logits_grad_fp32);
        } else {  // fp32 logits: .float() made no copy and no autograd node, the result is the grad
          transient.push_back(logits_grad_fp32);
        }
        break;
      }
      case ModuleNode::Role::kFinalNorm:
        for (const SavedTensor& t : head_.final_norm_backward) transient.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
        break;
      default: break;
    }
  }

  // Autograd's gradients of the parameters `node_id` owns that require them.
  void AllocGradients(int node_id) {
    for (int t : w_.nodes[node_id].tensors) {
      if (!w_.model.tensors[t].trainable) continue;
      unit_grad_pieces_[OwningUnit(node_id)].push_back(mem_.Alloc(Cat::kGradients, w_.model.tensors[t].numel() * pb_));
    }
  }

  // A block's backward at its softmax's (BlockActivations::softmax_backward): the MLP's
  // working gradients and the saved tensors whose backward has run are gone, the scores'
  // gradients come and go.
  struct SoftmaxBlock {
    int node = -1, output_projection = -1;  ///< the block, and its attention's output projection (-1: none)
    size_t saved_start = 0;                 ///< where its recomputed tensors begin in transients_
    size_t working = 0;                     ///< where its working transients (BlockActivations::backward_working) begin in transients_
  };
  void SoftmaxBackward(const SoftmaxBlock& b) {
    const BlockActivations& profile = BlockProfile(b.node);
    for (size_t i = 0; i < profile.backward_working.size(); ++i) mem_.Free(transients_[b.working + i]);
    mem_.Free(mlp_working_);  // routed experts' MLP moment, where the MLP's end has not freed it
    for (size_t i = 0; i < profile.recomputed.size(); ++i) {
      if (profile.recomputed[i].freed_by_softmax_backward) mem_.Free(transients_[b.saved_start + i]);
    }
    std::vector<BlockId>& saved = node_saved_[b.node];
    for (size_t i = 0; i < profile.kept.size() && i < saved.size(); ++i) {
      if (profile.kept[i].freed_by_softmax_backward) mem_.Free(saved[i]);
    }
    std::vector<BlockId> grads;
    for (const SavedTensor& t : profile.softmax_backward) grads.push_back(mem_.Alloc(Cat::kActivations, t.bytes));
    for (BlockId& g : grads) mem_.Free(g);
  }

  // The post-backward hook: the unit's gradient (FSDP1's one tensor, FSDP2's one per parameter),
  // kept unsharded under no_sync.
  void PostBackward(const Action& a) {
    const int u = a.unit;
    if (!Fsdp2()) mem_.ReleaseAllPending(Pool::kPostBackward);  // the previous unit's reduction has run
    std::vector<BlockId> grad = GatherUnitGrad(u);
    if (!a.reduces) {
      KeepUnsyncedGrad(u, std::move(grad));
      return;
    }
    FreeAll(kept_grad_[u]);  // accumulated in place, then reduced
    reduce_grad_[u] = std::move(grad);
  }

  void FreeAll(std::vector<BlockId>& blocks) {
    for (BlockId& b : blocks) mem_.Free(b);
    blocks.clear();
  }

  void Reduce(int u, int site) {
    const WrapUnit& unit = w_.units[u];
    // FSDP1 keeps autograd's gradient (autograd_computed_grad) until the hook returns, then
    // record_stream()s it to the post-backward stream.
    std::vector<BlockId> grads = std::exchange(reduce_grad_[u], {});
    const BlockId computed = Fsdp2() || grads.empty() ? kNoBlock : grads.front();  // FSDP1's one tensor
    BlockId shard = Fsdp2() ? ReduceFsdp2(unit, site, grads) : ReduceFsdp1(unit, computed);
    if (rb_ != mb_) {
      BlockId upcast = mem_.Alloc(Cat::kGradients, unit.SiteGradShardNumel(site) * mb_, Stream::kReduce);
      if (shard != computed) mem_.Free(shard);
      shard = upcast;
    }
    if (!Fsdp2() && shard != computed) {
      BlockId pending = computed;
      mem_.FreeToPending(pending, Pool::kPostBackward);
    }
    AccumulateShard(site_slot_[u] + site, shard);
  }

  // The unit's gradient: FSDP1 concatenates the views' gradients into the flat parameter's
  // gradient (split_with_sizes backward), whole-size even when part of it is frozen
  // (use_orig_params): one tensor. FSDP2 keeps autograd's per-parameter gradients, which
  // foreach_reduce copies into its reduce-scatter input.
  std::vector<BlockId> GatherUnitGrad(int u) {
    std::vector<BlockId> pieces = std::exchange(unit_grad_pieces_[u], {});
    const WrapUnit& unit = w_.units[u];
    if (Fsdp2() || pieces.empty() || (pieces.size() == 1 && unit.tensors.size() == 1)) return pieces;  // one parameter: its gradient is the unit's
    const BlockId flat = mem_.Alloc(Cat::kGradients, unit.numel * pb_);
    FreeAll(pieces);
    return {flat};
  }

  void KeepUnsyncedGrad(int u, std::vector<BlockId> grad) {
    if (kept_grad_[u].empty()) kept_grad_[u] = std::move(grad);
    else FreeAll(grad);  // added into the kept unsharded gradient
  }

  // FSDP1 _reduce_grad: cast to reduce_dtype, pad to the shard group, reduce-scatter into a new
  // shard (NO_SHARD: all-reduce in place; HYBRID_SHARD: then all-reduce the shard across replicas).
  // `computed` (autograd's gradient) is not freed here; intermediate copies are.
  BlockId ReduceFsdp1(const WrapUnit& unit, BlockId computed) {
    BlockId current = computed;
    if (rb_ != pb_) current = mem_.Alloc(Cat::kGradients, unit.numel * rb_, Stream::kReduce);
    if (!Sharded()) return current;
    if (unit.padded_numel != unit.numel) {
      BlockId padded = mem_.Alloc(Cat::kCommBuffers, unit.padded_numel * rb_, Stream::kReduce);
      if (current != computed) mem_.Free(current);
      current = padded;
    }
    BlockId shard = mem_.Alloc(Cat::kCommBuffers, unit.shard_numel * rb_, Stream::kReduce);
    if (current != computed) mem_.Free(current);
    return shard;
  }

  // FSDP2 post_backward: the previous reduce-scatter input (reduce_scatter_state) is released, then
  // foreach_reduce copies the gradients into a reduce_dtype buffer of the padded size and
  // reduce-scatters it into a shard; the input is kept until the next post_backward.
  BlockId ReduceFsdp2(const WrapUnit& unit, int site, std::vector<BlockId>& grads) {
    mem_.Free(fsdp2_rs_deferred_);
    BlockId input = mem_.Alloc(Cat::kCommBuffers, unit.SiteGradPaddedNumel(site) * rb_);
    FreeAll(grads);
    BlockId shard = mem_.Alloc(Cat::kCommBuffers, unit.SiteGradShardNumel(site) * rb_, Stream::kReduce);
    fsdp2_rs_deferred_ = input;
    return shard;
  }

  // `slot`: the unit's sharded gradient, or its hook site's (site_slot_)
  void AccumulateShard(int slot, BlockId shard) {
    if (c_.cpu_offload) {  // copied into the pinned host gradient (host memory counted separately)
      mem_.Free(shard);
      return;
    }
    if (sharded_grad_[slot] == kNoBlock) {
      sharded_grad_[slot] = shard;
      mem_.Recategorize(shard, Cat::kGradients);
    } else {
      mem_.Free(shard);  // added into _saved_grad_shard
    }
  }

  void OptimizerStep() {
    if (!c_.cpu_offload && !states_allocated_) AllocOptimizerStates();
    if (!c_.cpu_offload && (c_.optimizer == Optimizer::kAdamW || c_.optimizer == Optimizer::kAdam)) {
      // _multi_tensor_adam: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs), a temporary per state
      // in the states' dtype (the master dtype: bf16 under pure bf16)
      std::vector<BlockId> temps;
      for (int64_t numel : StateShardNumels()) temps.push_back(mem_.Alloc(Cat::kOptimizerStates, numel * mb_));
      for (BlockId& t : temps) mem_.Free(t);
    }
    phases_.Enter(StepPhase::kAfterZeroGrad);
    mem_.SetPhase(phases_.phase());
    for (BlockId& b : sharded_grad_) mem_.Free(b);
    for (std::vector<BlockId>& unit : unsharded_) FreeAll(unit);
  }

  const Workload& w_;
  const FsdpConfig& c_;
  const Schedule& schedule_;
  MemoryTracker& mem_;
  bool skip_repeats_;
  BlockProfiles profiles_;
  HeadActivations head_;
  int64_t pb_ = 2, rb_ = 4, mb_ = 4;
  /// ResidualStreamApart: the hidden states' bytes (0: the stream is saved tensors), the embedding's
  /// output and the hidden states the next block reads (the last block's output, or that same one).
  /// ResidualStreamCarried: `stream_` alone, made by the embedding or a block's end and handed to
  /// the next block's list (its "block.input"), or freed by the final norm
  int64_t hidden_bytes_ = 0;
  bool stream_carried_ = false;
  bool post_mlp_norm_ = false;  ///< the block's last tensor before its output is its post-MLP norm's output (else down's)
  BlockId embedded_ = kNoBlock, stream_ = kNoBlock;
  int64_t skipped_retries_ = 0;     // the allocator retries of the micro-batches PlayMicroBatches skipped
  Nf4Transient nf4_;  // QLoRA: the largest quantized weight's dequantization transient
  bool states_allocated_ = true;  ///< the optimizer states exist (false until the first step's optimizer.step())
  PhaseTracker phases_;
  std::vector<std::vector<BlockId>> unsharded_;  // FSDP1: the flat parameter; FSDP2: one per parameter
  std::vector<BlockId> sharded_grad_;
  std::vector<std::vector<BlockId>> kept_grad_;  ///< per unit: the unsharded gradient kept under no_sync
  std::vector<int> site_slot_;  // per unit: its first slot in sharded_grad_ (one per hook site)
  std::vector<std::vector<BlockId>> reduce_grad_;  ///< per unit: the gradient its post-backward hands to the reduction
  std::vector<std::vector<BlockId>> unit_grad_pieces_;
  std::vector<std::vector<BlockId>> node_saved_;
  std::vector<BlockId> transients_;       ///< backward transients of the nodes entered and not yet left
  std::vector<size_t> transient_starts_;  ///< per entered node: where its transients begin
  std::optional<SoftmaxBlock> softmax_block_;  ///< the block in backward whose softmax's has not run yet (blocks do not nest)
  int mlp_moment_at_ = -1;                    ///< the down projection whose backward's exit has the MLP's moment
  int64_t mlp_moment_bytes_ = 0;
  BlockId mlp_working_ = kNoBlock;            ///< without a down projection: the MLP's moment, held through the MLP's backward
  int mlp_working_until_ = -1;                ///< the node whose backward exit frees it (the MLP's, or the block's)
  /// A saved tensor of the block in backward, released at the end of `node`'s backward:
  /// in transients_ (recomputed) or node_saved_[block] (kept), at `index`
  struct Release {
    int node = -1;
    bool transient = false;
    size_t index = 0;
    int block = -1;
  };
  std::vector<Release> releases_;
  /// ModuleUnder's modules, by path inside the block (static text or the architecture's strings,
  /// which outlive the replay), at their node's offset from the block's where first found
  struct ReleaseOffset {
    std::string_view relative;
    int offset = 0, depth = 0;  ///< from the block's node; levels below the block
  };
  std::vector<ReleaseOffset> release_offsets_;
  static constexpr int kNoMask = -2, kUnheldMask = -1;
  /// Eager attention's [B, 1, s, s] masks, full-attention and sliding-window: each kind's, and the
  /// first checkpointed block that reads it (its backward releases it; kUnheldMask: none, freed
  /// after the forward; kNoMask: no layer of that kind)
  std::array<BlockId, 2> masks_{kNoBlock, kNoBlock};
  std::array<int, 2> mask_holder_{kNoMask, kNoMask};
  int embedding_node_ = -1;           ///< a tied lm_head's weight: its gradient exists from lm_head's backward
  BlockId fsdp2_deferred_ = kNoBlock;
  BlockId held_logits_ = kNoBlock;  ///< logits the loop still references (loop_holds_outputs)
  std::vector<BlockId> cache_;       ///< this forward's past_key_values so far (use_cache)
  std::vector<BlockId> held_cache_;  ///< the previous output's past_key_values (use_cache and loop_holds_outputs)
  BlockId fsdp2_rs_deferred_ = kNoBlock;
  /// FsdpConfig::ac_reentrant under FSDP1: the inputs of the frozen blocks whose backward has run
  /// and the gradients computed for them, held by FSDP1's reshard-only hooks until backward ends
  std::vector<BlockId> reentrant_held_;
  int64_t reentrant_above_grad_bytes_ = 0;  ///< the held input's bytes of the block whose backward ran last (0: none held)
};

// NCCL communicators a rank creates. On one GPU FSDP1 still all-reduces NO_SHARD's gradients
// through the default process group (_runtime_utils._reduce_grad_no_shard calls dist.all_reduce
// whatever the group's size), which creates its communicator; FSDP2 on one GPU all-gathers
// nothing and copies where it would reduce-scatter (_fsdp_collectives.foreach_reduce, world_size 1).
int64_t CommunicatorCount(const Workload& w) {
  if (w.config.gpus <= 1) return w.config.framework == Framework::kFsdp1 ? 1 : 0;
  if (w.config.strategy == Strategy::kHybridShard && w.shard_world > 1 && w.replicas > 1) return 2;
  return 1;
}

CheckpointMemory EstimateCheckpoint(const Workload& w) {
  CheckpointMemory ck;
  int64_t params_bytes = 0, trainable = 0, largest_unit_bytes = 0;  // the units partition the parameters
  for (const auto& u : w.units) {
    int64_t unit_bytes = 0;
    for (int t : u.tensors) unit_bytes += w.model.tensors[t].numel() * BytesPerElement(StorageDtype(w.config, w.model.tensors[t]));
    params_bytes += unit_bytes;
    trainable += u.trainable_numel;
    largest_unit_bytes = std::max(largest_unit_bytes, unit_bytes + (u.padded_numel - u.numel) * BytesPerElement(w.config.master_dtype));
  }
  const int64_t states = OptimizerStateBytesPerParam(w.config.optimizer, w.config.master_dtype);
  // FULL_STATE_DICT all-gathers each unit in full precision (_full_prec_full_param_padded) and
  // clones its parameters: to the GPU (accumulating the whole model) or to the CPU.
  ck.full_gpu_extra_bytes = params_bytes + largest_unit_bytes;
  ck.full_offload_gpu_extra_bytes = largest_unit_bytes;
  ck.full_offload_host_rank0_bytes = params_bytes;
  ck.full_offload_host_per_node_bytes = params_bytes * w.config.gpus_per_node;
  ck.full_optim_host_rank0_bytes = trainable * states;
  ck.sharded_gpu_extra_bytes = 0;
  ck.model_file_bytes = params_bytes;
  ck.optimizer_file_bytes = trainable * states;
  const int64_t writers = w.config.strategy == Strategy::kNoShard ? 1 : w.shard_world;
  ck.sharded_file_bytes_per_rank = CeilDiv(params_bytes + trainable * states, writers);
  return ck;
}

}  // namespace

int OptimizerStateCount(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kAdam: return 2;   // exp_avg, exp_avg_sq
    case Optimizer::kSgdMomentum: return 1;  // momentum_buffer
    case Optimizer::kSgd: return 0;
  }
  return 0;
}

RoutedExpertBytes RoutedExpertBytesPerGpu(const Workload& w) {
  RoutedExpertBytes e;
  const FsdpConfig& c = w.config;
  const int64_t master = BytesPerElement(c.master_dtype), states = OptimizerStateBytesPerParam(c.optimizer, c.master_dtype);
  for (const TensorSpec& t : w.model.tensors) {
    if (t.active_share >= 1) continue;
    const int64_t shard = Fsdp2ShardNumel(t, w.shard_world);
    e.params += t.LogicalNumel();
    e.active_params_per_token += static_cast<double>(t.LogicalNumel()) * t.active_share;
    e.sharded_param_bytes += shard * BytesPerElement(StorageDtype(c, t));
    if (!t.trainable) continue;
    e.gradient_bytes += shard * master;
    e.optimizer_state_bytes += shard * states;
  }
  return e;
}

int64_t OptimizerStateBytesPerParam(Optimizer optimizer, DType master_dtype) {
  return OptimizerStateCount(optimizer) * BytesPerElement(master_dtype);
}

FrameworkOverheads FrameworkOverheadsFor(const Workload& w) {
  FrameworkOverheads o;
  o.cuda_context_bytes = w.hardware.cuda_context_bytes;
  o.nccl_bytes_per_communicator = kNcclChannels * kNcclConnectionsPerChannel *
                                  (kNcclSimpleBufferBytes + kNcclLl128BufferBytes + kNcclLlBufferBytes);
  const auto& arch = w.hardware.architecture;
  int64_t per_thread = kCublasWorkspaceOlder;
  if (arch == "hopper" || arch == "blackwell") per_thread = kCublasWorkspaceSm90;
  if (arch == "cdna3") per_thread = kHipblasWorkspaceGfx94x;
  if (arch != "cpu") {
    for (int64_t t = 0; t < kBlasThreads; ++t) {  // (two push_backs: GCC 12's -Wstringop-overflow misfires on an initializer-list insert)
      o.cublas_workspace_blocks.push_back(per_thread);
      o.cublas_workspace_blocks.push_back(kCublasLtWorkspace);
    }
  }
  o.cublas_workspace_bytes = std::accumulate(o.cublas_workspace_blocks.begin(), o.cublas_workspace_blocks.end(), int64_t{0});
  if (auto alloc = ParseAllocatorConfig(w.config.alloc_conf); alloc.ok()) o.allocator = alloc.value();  // validated with the flags
  return o;
}

ReplayOptions ReplayOptionsFor(const FrameworkOverheads& o, bool record_timeline) {
  ReplayOptions r;
  r.rounding_bytes = o.allocation_rounding_bytes;
  r.record_timeline = record_timeline;
  r.allocator = o.allocator;
  r.allocator.per_process_memory_fraction = 1.0;  // a cap on the card's memory: ReplayOnCard's alone
  r.caching_allocator = o.caching_allocator;
  r.one_stream = o.one_stream;
  r.cublas_workspace_blocks = o.cublas_workspace_blocks;
  return r;
}

MemoryEstimate EstimateTensorMemory(const Workload& w, const ReplayOptions& options) {
  return EstimateTensorMemory(w, BuildSchedule(w), options);
}

MemoryEstimate EstimateTensorMemory(const Workload& w, const Schedule& schedule, const ReplayOptions& options) {
  MemoryEstimate e;
  std::unique_ptr<MemoryTracker> tracker =
      options.caching_allocator ? std::make_unique<MemoryTracker>(options.rounding_bytes, options.record_timeline, options.allocator,
                                                                  options.reserve_limit_bytes, options.device_bytes, options.one_stream)
                                : std::make_unique<MemoryTracker>(options.rounding_bytes, options.record_timeline);
  MemoryTracker& mem = *tracker;
  std::vector<TrackedRequest> requests;
  if (options.record_requests) mem.RecordRequests(&requests);
  StepPlayer player(w, schedule, mem, options.skip_repeated_micro_batches && !options.record_requests);
  player.Play(e.host, options.cublas_workspace_blocks);
  e.requests.reserve(requests.size());
  for (const TrackedRequest& r : requests) {
    e.requests.push_back(HistoryEvent{r.action, r.address, r.bytes, r.stream, PhaseName(w, r.phase) + " / " + std::string(MemCategoryKey(r.category))});
  }
  e.allocated_peak_bytes = mem.allocated_peak();
  e.allocated_peak_phase = PhaseName(w, mem.allocated_peak_phase());
  e.allocated_blocks_peak_bytes = e.allocated_peak_bytes;
  e.pending_free_bytes_at_peak = mem.pending_at_peak();
  e.peak = mem.device_peak();
  e.active_peak_bytes = TotalBytes(e.peak);
  e.peak_phase = PhaseName(w, mem.device_peak_phase());
  e.reserved_peak_bytes = TotalBytes(e.peak);
  e.reserved_peak_phase = e.peak_phase;
  if (const CachingAllocator* allocator = mem.allocator()) {
    const AllocatorStats& a = allocator->stats();
    e.reserved_peak_bytes = a.reserved_peak_bytes;
    e.allocated_blocks_peak_bytes = a.allocated_peak_bytes;
    e.active_peak_bytes = a.active_peak_bytes;
    e.reserved_peak_phase = PhaseName(w, mem.reserved_peak_phase());
    e.fragmentation_bytes = a.reserved_peak_bytes - a.allocated_at_reserved_peak_bytes;
    e.alloc_retries = a.num_alloc_retries + player.skipped_retries();
    e.small_pool = a.small_pool;
    e.large_pool = a.large_pool;
    e.device_allocs = a.num_device_alloc;
    e.allocator_out_of_memory = mem.out_of_memory();
    if (mem.reserved_peak_in_first_step()) e.reserved_peak_phase = "first step, " + e.reserved_peak_phase;
    // At the peak: the tensors at their steady-state peak and, as framework overhead, the rest of
    // the reserve (cached and unallocated then; reserved never falls below the tensors).
    e.peak[static_cast<int>(Cat::kFramework)] += std::max<int64_t>(0, e.reserved_peak_bytes - TotalBytes(e.peak));
  }
  e.host_bytes = TotalBytes(e.host);
  e.checkpoint = EstimateCheckpoint(w);
  for (TrackedPoint& p : mem.TakeTimeline()) {
    e.timeline.push_back(MemoryPoint{PhaseName(w, p.phase), p.phase.kind, p.phase.node, p.phase.micro, p.phase.action, p.device, p.reserved_bytes});
  }
  return e;
}

int64_t IsolatedWorkspaceBytes(const FrameworkOverheads& o) {
  if (o.caching_allocator && o.allocator.expandable_segments) return -1;
  int64_t small = 0, total = 0;
  for (int64_t b : o.cublas_workspace_blocks) {
    const int64_t rounded = RoundAllocationSize(o.allocator, b);
    if (rounded <= alloc::kSmallSize) {
      if (rounded != alloc::kSmallBuffer / 2) return -1;
      ++small;
    } else if (rounded < alloc::kMinLargeAlloc || rounded % alloc::kRoundLarge != 0) {
      return -1;
    }
    total += rounded;
  }
  return small % 2 == 0 ? total : -1;
}

void AddHeldBytes(MemoryEstimate& e, int64_t bytes) {
  e.allocated_peak_bytes += bytes;
  e.allocated_blocks_peak_bytes += bytes;
  e.active_peak_bytes += bytes;
  e.reserved_peak_bytes += bytes;
  e.peak[static_cast<int>(Cat::kFramework)] += bytes;
  for (MemoryPoint& p : e.timeline) {
    p.device[static_cast<int>(Cat::kFramework)] += bytes;
    p.reserved_bytes += bytes;
  }
}

int64_t OutsideAllocatorBytes(const Workload& w, const FrameworkOverheads& o) {
  return o.cuda_context_bytes + CommunicatorCount(w) * o.nccl_bytes_per_communicator;
}

int64_t ReserveLimitBytes(const Workload& w, const FrameworkOverheads& o) { return w.hardware.DeviceTotalBytes() - OutsideAllocatorBytes(w, o); }

// The caching allocator's own cap on the card (per_process_memory_fraction); -1 where none is set.
static int64_t FractionCapBytes(const Workload& w, const FrameworkOverheads& o) {
  return o.caching_allocator ? FractionCapBytes(o.allocator, w.hardware.DeviceTotalBytes()) : -1;
}

bool NeedsReplayOnCard(const Workload& w, const FrameworkOverheads& o, const MemoryEstimate& tensors) {
  // A memory fraction's cap and the garbage collection it enables act on the card's total memory,
  // which the unlimited replay does not know.
  if (FractionCapBytes(w, o) >= 0) return true;
  const int64_t reserve_limit = ReserveLimitBytes(w, o);
  return o.caching_allocator && tensors.reserved_peak_bytes > reserve_limit && tensors.allocated_peak_bytes <= reserve_limit;
}

MemoryEstimate ReplayOnCard(const Workload& w, const FrameworkOverheads& o, bool with_timeline) {
  ReplayOptions limited = ReplayOptionsFor(o, with_timeline);
  limited.reserve_limit_bytes = ReserveLimitBytes(w, o);
  limited.device_bytes = w.hardware.DeviceTotalBytes();
  limited.allocator.per_process_memory_fraction = o.allocator.per_process_memory_fraction;
  return EstimateTensorMemory(w, limited);
}

MemoryEstimate AddFrameworkTerms(const Workload& w, const FrameworkOverheads& o, const MemoryEstimate& tensors, bool with_timeline,
                                 const MemoryEstimate* on_card) {
  MemoryEstimate e = tensors;
  if (!with_timeline) e.timeline.clear();
  e.overheads = o;
  const int64_t outside = OutsideAllocatorBytes(w, o);
  e.capacity_bytes = w.hardware.DeviceTotalBytes();
  if (NeedsReplayOnCard(w, o, tensors)) {
    // Over the card on an unlimited replay, but not hopeless: PyTorch would free its cache and
    // retry. Replay on the card's memory to see whether that saves it.
    MemoryEstimate replay = on_card ? *on_card : ReplayOnCard(w, o, with_timeline);
    if (!replay.allocator_out_of_memory) {
      replay.host = tensors.host;
      replay.host_bytes = tensors.host_bytes;
      if (!with_timeline) replay.timeline.clear();
      e = std::move(replay);
      e.overheads = o;
      e.capacity_bytes = w.hardware.DeviceTotalBytes();
    } else {
      e.alloc_retries = replay.alloc_retries;
      e.allocator_out_of_memory = true;
    }
  }
  const auto extra = static_cast<int64_t>(o.fragmentation_fraction * static_cast<double>(e.reserved_peak_bytes));
  e.peak[static_cast<int>(Cat::kFramework)] += outside + extra;
  e.peak_bytes = TotalBytes(e.peak);
  e.headroom_bytes = e.capacity_bytes - e.peak_bytes;
  e.allocator_cap_bytes = FractionCapBytes(w, o);
  if (e.allocator_cap_bytes >= 0) e.headroom_bytes = std::min(e.headroom_bytes, e.allocator_cap_bytes - e.reserved_peak_bytes - extra);
  e.fits = e.headroom_bytes >= 0 && !e.allocator_out_of_memory;
  return e;
}

MemoryEstimate EstimateMemory(const Workload& w, const MemoryOptions& options) {
  return AddFrameworkTerms(w, options.overheads, EstimateTensorMemory(w, ReplayOptionsFor(options.overheads, options.record_timeline)));
}

MemoryEstimate EstimateMemory(const Workload& w) {
  MemoryOptions options;
  options.overheads = FrameworkOverheadsFor(w);
  return EstimateMemory(w, options);
}

}  // namespace fsdp
