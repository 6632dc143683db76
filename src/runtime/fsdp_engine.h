// fsdp-run's FSDP engine on the CPU: flat parameter per wrap unit (the Workload's units), padded
// to the shard group and sharded across ranks; unshard = all-gather into a buffer rounded to
// param_dtype; reshard = free, following the strategy (the root stays unsharded until its
// backward); gradients reduce-scattered (rounded to reduce_dtype) into shards in the master dtype
// (fp32, or bf16 for pure bf16: MasterBuffer), all-reduced
// across HYBRID_SHARD replicas (NO_SHARD: all-reduced); sharded AdamW, with dynamic loss scaling
// when asked (ShardedGradScaler's: loss scaled, shards unscaled, inf/NaN steps skipped); activation checkpointing
// (full: a block's forward rerun in its backward; selective: its attention probabilities
// recomputed); gradient accumulation; LoRA under FSDP2 (the frozen base sharded and gathered, no
// gradient or optimizer state for it, the adapters trained: EngineLayout), and under FSDP1 with
// use_orig_params (the flat gradient covers the frozen base, AdamW steps the adapters' parts).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "core/phase.h"
#include "core/schedule.h"
#include "core/workload.h"
#include "runtime/comm.h"
#include "runtime/llama_model.h"
#include "runtime/loss_scaler.h"
#include "runtime/memory_ledger.h"
#include "runtime/nf4.h"
#include "runtime/safetensors.h"

namespace fsdp::runtime {

struct TrainOptions {
  uint64_t seed = 1;        ///< initialisation and synthetic tokens
  /// AdamW's hyperparameters, doubles as Python passes them to torch.optim.AdamW (1 - 0.9f is not 1 - 0.9)
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.01;
  std::vector<int32_t> tokens;   ///< a token stream to train on (cycled); empty: seeded synthetic tokens
  std::shared_ptr<const Checkpoint> checkpoint;  ///< weights to start from (--init-from); null: seeded values
  LossScalerOptions loss_scaling;  ///< dynamic loss scaling (fp16): a step with inf/NaN gradients is skipped
};

/// Rounds to the nearest value representable in `dtype`, ties to even, with the dtype's range:
/// beyond it to inf (bf16 above 3.39e38, fp16 above 65504), fp16 subnormals in steps of 2^-24;
/// inf and NaN pass through.
float RoundTo(float value, DType dtype);

/// What a rank stores of a flat buffer in the master dtype (sharded parameters, sharded gradients,
/// AdamW's states): fp32, or for pure bf16 training (--master-dtype bf16) bf16, held as the upper
/// 16 bits of the fp32 value, 2 bytes an element. Set rounds to the dtype.
class MasterBuffer {
 public:
  MasterBuffer() = default;
  /// `count` elements of `value`.
  MasterBuffer(DType dtype, size_t count, float value = 0.0f);
  float Get(size_t i) const;
  void Set(size_t i, float value);
  size_t size() const { return dtype_ == DType::kBf16 ? bf16_.size() : fp32_.size(); }
  bool empty() const { return size() == 0; }
  int64_t Bytes() const { return static_cast<int64_t>(size()) * (dtype_ == DType::kBf16 ? 2 : 4); }
  /// Frees the storage (zero_grad(set_to_none=True)).
  void Release();

 private:
  DType dtype_ = DType::kFp32;
  std::vector<float> fp32_;
  std::vector<uint16_t> bf16_;
};

/// A rank's shard of a unit's flat buffer (EngineLayout): the frozen group's F_u / W elements in the
/// frozen base's dtype (FrozenStorageDtype: LoRA's --base-dtype), then the trained group's in the
/// master dtype, each a MasterBuffer; elements indexed across both, as one shard.
class ShardBuffer {
 public:
  ShardBuffer() = default;
  ShardBuffer(DType frozen_dtype, size_t frozen_count, DType trained_dtype, size_t trained_count)
      : frozen_(frozen_dtype, frozen_count), trained_(trained_dtype, trained_count) {}
  float Get(size_t i) const { return i < frozen_.size() ? frozen_.Get(i) : trained_.Get(i - frozen_.size()); }
  /// Rounds to the element's group's dtype.
  void Set(size_t i, float value) { i < frozen_.size() ? frozen_.Set(i, value) : trained_.Set(i - frozen_.size(), value); }
  size_t size() const { return frozen_.size() + trained_.size(); }
  int64_t Bytes() const { return frozen_.Bytes() + trained_.Bytes(); }

 private:
  MasterBuffer frozen_, trained_;
};

/// QLoRA: where each unit's own tensors (not its adapters) sit in its compute buffer
/// (Nf4ComputeNumel elements, core/lora.h), packed in inventory order at their LogicalNumel (a
/// quantized weight dequantized): per tensor, -1 for adapters and for the tensors of units
/// without a quantized weight.
std::vector<int64_t> ComputeOffsets(const Workload& workload);

/// How fsdp-run's engines lay out each unit. Its flat buffer (padded_numel) holds two groups, each
/// packed in inventory order and padded at its end: first the tensors FSDP reduces no gradient for
/// (F_u = padded_numel - grad_padded_numel elements: a frozen unit whole, LoRA's base under FSDP2),
/// then the rest (G_u = grad_padded_numel: its gradient, its optimizer states). Each group is
/// sharded on its own, so a rank's shard is F_u / W frozen then G_u / W trained elements, and the
/// gradient shard lines up with the trained one. Without frozen tensors this is
/// Workload::tensor_offset.
struct EngineLayout {
  std::vector<int64_t> offset;         ///< per tensor: its first element in its unit's flat buffer
  std::vector<int64_t> frozen_padded;  ///< per unit: F_u
  /// Whether tensor t sits in its unit's trained group.
  bool Trained(const Workload& workload, int t) const;
};
EngineLayout LayoutOf(const Workload& workload);

class FsdpEngine {
 public:
  /// `world` is every rank; the engine splits shard and replica groups from it. Supports the
  /// models DimsOf accepts with block or whole-model wrapping, and LoRA (with or without lora_dropout:
  /// DropoutKey) under FSDP2, its frozen base stored in its own dtype (ShardBuffer), or under FSDP1
  /// with use_orig_params, the base in the master dtype (BuildWorkload refuses a unit of two dtypes).
  /// QLoRA: the blocks' linears stored as NF4 (runtime/nf4.h) packed into bf16 or fp32 elements
  /// that are sharded and all-gathered as any frozen parameter, dequantized after each all-gather
  /// into the unit's compute buffer, the absmax double-quantized or not.
  static Result<std::unique_ptr<FsdpEngine>> Create(const Workload& workload, Comm& world, const TrainOptions& options);

  /// Rehearse an out-of-memory: fail with the phase and category when the rank's heap exceeds it.
  void set_memory_limit(int64_t bytes) { ledger_.set_limit(bytes); }

  /// One optimizer step over `grad_accum` micro-batches of this rank's share of the global batch;
  /// returns the loss averaged over every rank's tokens.
  Result<float> Step(int64_t step_index);

  const CommStats& shard_stats() const { return shard_comm_->stats(); }
  const CommStats& replica_stats() const { return replica_comm_->stats(); }
  int64_t shard_world() const { return shard_world_; }
  const MemoryLedger& memory() const { return ledger_; }
  /// Wall time spent per phase over all steps so far (collective times are in the CommStats).
  struct PhaseTimes {
    double forward_s = 0, backward_s = 0, optimizer_s = 0;
  };
  const PhaseTimes& times() const { return times_; }
  /// The loss scale and the steps skipped for inf/NaN gradients (every rank agrees).
  const LossScaler& loss_scaler() const { return scaler_; }

 private:
  FsdpEngine(const Workload& w, Comm& world, const TrainOptions& o) : w_(w), world_(world), o_(o), schedule_(BuildSchedule(w)), phases_(w), scaler_(o.loss_scaling) {
    ledger_.set_namer([&w](const Phase& p) { return PhaseName(w, p); });
    ledger_.set_phase(Phase{StepPhase::kInitialisation});
  }
  /// Whether any rank's gradient shards hold an inf or NaN (ShardedGradScaler.unscale_'s check,
  /// its flag summed over every rank).
  Result<bool> FoundNonFinite();
  Status Init();
  /// The schedule's unshard: a blocking all-gather, or for a prefetch one started without waiting
  /// (at most one is ever in flight: each is waited for at its unit's own hook). The rate limiter
  /// never waits here: a reshard of this engine has finished when it returns.
  Status Unshard(int u, bool prefetch);
  Status WaitUnshard(int u);
  void Reshard(int u);
  Status Reduce(int u);
  Result<float> MicroBatch(int64_t step, int64_t micro);
  struct Pass;  // one micro-batch's activations (fsdp_engine.cc)
  Status ForwardNode(int node, Pass& pass);
  Status BackwardNode(int node, Pass& pass);
  /// Module node `node`'s parameters in its unit's unsharded buffer (its own tensors, then its
  /// adapters), and its gradients: null where the unit reduces none for them (FSDP2's frozen
  /// group); under FSDP1 the flat gradient covers a frozen base, which BlockBackward leaves unwritten.
  BlockWeights Params(int node) const;
  BlockGrads Grads(int node);
  /// Whether the node's own tensors (not its adapters) get gradients.
  bool Trains(int node) const;
  Status Optimizer();

  const Workload& w_;
  Comm& world_;
  TrainOptions o_;
  Schedule schedule_;
  PhaseTracker phases_;
  LlamaDims dims_{};
  std::unique_ptr<Comm> shard_comm_, replica_comm_;
  int64_t shard_world_ = 1;
  EngineLayout layout_;
  std::vector<ShardBuffer> shard_;        // per unit, S_u elements: the frozen group's shard, then the trained group's
  std::vector<MasterBuffer> grad_shard_;  // per unit, the trained group's shard (grad_shard_numel)
  std::vector<std::vector<ElementRun>> stepped_;  // per unit, what of that shard AdamW steps (SteppedShardRuns)
  std::vector<MasterBuffer> exp_avg_, exp_avg_sq_;  // per unit, packed over stepped_
  std::vector<std::vector<float>> full_, full_grad_;                // per unit while live: P_u floats, the trained group's G_u
  // QLoRA: per tensor, a quantized weight's quantization state (its absmax per 64, or those
  // double-quantized; whole on every rank, as bitsandbytes keeps it on the module outside what
  // FSDP shards); per unit while
  // unsharded, its own tensors (not its adapters) in their computed form, packed by
  // compute_offset_ (per tensor): the quantized weights dequantized, the rest copied; empty for a
  // unit without quantized weights, whose Params point into full_
  std::vector<Nf4QuantState> nf4_state_;
  std::vector<std::vector<float>> compute_;
  std::vector<int64_t> compute_offset_;
  /// Fills compute_[u] from the gathered full_[u] (QLoRA: bitsandbytes' dequantize_4bit of every
  /// quantized weight in fp32, rounded to the compute dtype, QloraComputeDtype); nothing for a unit
  /// without quantized weights.
  void Dequantize(int u);
  std::vector<int> first_adapter_;  // per module node: a block's first adapter tensor, -1 for none
  struct InFlight {
    int unit;
    std::vector<float> low;    // the all-gather input, alive until the wait
    std::vector<int> handles;  // one all-gather per group
  };
  std::vector<InFlight> in_flight_;
  Status WaitFor(size_t index);
  MemoryLedger ledger_;
  PhaseTimes times_;
  LossScaler scaler_;
  int64_t optimizer_steps_ = 0;  // AdamW's step count: skipped steps do not count (torch.optim's state["step"])
};

/// The index in the whole run of the first of a rank's micro-batch's micro_batch sequences:
/// ((step * grad_accum + micro) * world + rank) * micro_batch.
int64_t FirstSequence(const Workload& workload, int64_t step, int64_t micro, int rank, int world);

/// The tokens of one rank's micro-batch: micro_batch sequences of seq_len + 1 tokens (inputs and
/// shifted targets), sequence index FirstSequence + i;
/// consecutive windows of options.tokens when given, else a seeded start and t' = (5 t + 3) mod V.
std::vector<int32_t> TrainingTokens(const Workload& workload, const TrainOptions& options, int64_t step, int64_t micro, int rank, int world);


/// Deterministic initial values of unit u's flat buffer (padded_numel, in `layout`), independent
/// of the world size (a QLoRA weight's drawn as for its unquantized self, then quantized as
/// StartingUnit says): norms 1, LoRA's lora_A as peft initialises it (kaiming_uniform_ with a =
/// sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and lora_B 0, everything else N(0, 0.02), from mt19937_64
/// seeded per tensor; padding 0.
std::vector<float> InitialUnit(const Workload& workload, const EngineLayout& layout, int u, uint64_t seed,
                               std::vector<Nf4QuantState>* nf4_state = nullptr);

/// The checkpoint tensor `tensor` starts from: its own name; for LoRA's wrapped weight
/// ("<module>.base_layer.weight") the base model's ("<module>.weight") when the checkpoint does not
/// have the wrapped name; for an adapter ("<module>.lora_A.default.weight") its own name or the
/// one peft's save_pretrained writes ("base_model.model.<module>.lora_A.weight"), "" when the
/// checkpoint has neither (it starts as peft initialises it).
std::string CheckpointTensorName(const Checkpoint& checkpoint, const TensorSpec& tensor);

/// A checkpoint tensor read into the next elements of a model tensor.
struct CheckpointPiece {
  std::string name;
  std::vector<int64_t> shape;
};
/// Where `tensor`'s values are in `checkpoint`, in its row-major order: the one tensor
/// CheckpointTensorName names (a QLoRA weight's unquantized values, TensorSpec::nf4_numel of them,
/// in the shape the checkpoint gives them: bitsandbytes quantizes them as they load) or, for transformers 5's fused experts (mlp.experts.gate_up_proj
/// [E, 2 I, h], mlp.experts.down_proj [E, h, I]) the checkpoint does not hold fused, the Hub's
/// per-expert tensors save_pretrained writes (mlp.experts.<e>.gate_proj.weight [I, h], up_proj,
/// down_proj [h, I]): per expert gate's rows then up's, as transformers' conversion_mapping.py
/// merges them for qwen2_moe and qwen3_moe (MergeModulelist(dim=0), Concatenate(dim=1)). Empty
/// when the checkpoint lacks an adapter.
std::vector<CheckpointPiece> CheckpointPieces(const Checkpoint& checkpoint, const TensorSpec& tensor);

/// Unit u's starting flat buffer (padded_numel, in `layout`): each tensor read from
/// options.checkpoint when there is one (CheckpointPieces; BadInput when it lacks one or its
/// shape differs), else InitialUnit's seeded values. A QLoRA weight (TensorSpec::nf4_numel) is
/// quantized as bitsandbytes does on loading (Nf4Quantize of its values rounded to the storage
/// dtype, FrozenStorageDtype): its packed bytes as storage elements in the buffer
/// (Nf4StorageElements), its quantization state (Nf4StateOf: double-quantized under
/// bnb_4bit_use_double_quant) into (*nf4_state)[tensor] when nf4_state is given.
Result<std::vector<float>> StartingUnit(const Workload& workload, const EngineLayout& layout, int u, const TrainOptions& options,
                                        std::vector<Nf4QuantState>* nf4_state = nullptr);

/// AdamW's bias corrections 1 - beta^t for the step after `steps_taken` applied steps.
struct AdamCorrections {
  float c1, c2;
};
AdamCorrections AdamBiasCorrections(const TrainOptions& options, int64_t steps_taken);

/// One element of torch.optim.AdamW's step as _single_tensor_adamw (torch/optim/adamw.py, the CPU
/// default) runs it, each tensor op computed in fp32 and its result rounded to `dtype` (the
/// parameters' and states' dtype, as ATen's bf16 kernels do): p *= 1 - lr wd; m = lerp(m, g,
/// 1 - beta1); v = v beta2; v += (1 - beta2) g g; d = sqrt(v); d /= sqrt(1 - beta2^t); d += eps;
/// p += -(lr / (1 - beta1^t)) m / d. The scalars are computed in double, as Python does, then used
/// as fp32. `steps_taken` is the number of steps applied before this one.
struct AdamWScalars {
  float decay, lerp_weight, beta2, one_minus_beta2, bias2_sqrt, eps, step_size;
};
AdamWScalars AdamWStepScalars(const TrainOptions& options, int64_t steps_taken);
void AdamWUpdate(const AdamWScalars& s, DType dtype, float grad, float& param, float& exp_avg, float& exp_avg_sq);

/// BadInput naming the first frozen parameter, if any: the GPU engine trains every parameter (LoRA
/// and QLoRA train on the CPU engine; fsdp-plan and fsdp-sim plan it for GPUs), and without LoRA neither
/// engine freezes any.
Status CheckEveryParameterTrains(const Workload& workload);

/// A hash of the configuration every rank must agree on (Comm::CheckSame).
uint64_t ConfigFingerprint(const Workload& workload, const TrainOptions& options);


}  // namespace fsdp::runtime
