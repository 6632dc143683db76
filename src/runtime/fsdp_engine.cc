#include "runtime/fsdp_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "core/lora.h"
#include "runtime/nf4.h"

namespace fsdp::runtime {

float RoundTo(float value, DType dtype) {
  if (dtype == DType::kFp32 || !std::isfinite(value) || value == 0.0f) return value;
  if (dtype == DType::kBf16) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even on the upper 16 bits (overflows to inf)
    bits &= 0xFFFF0000u;
    std::memcpy(&value, &bits, 4);
    return value;
  }
  // fp16 (IEEE binary16): 10 mantissa bits, exponents down to -14 (below that, subnormals in steps
  // of 2^-24), largest finite 65504; round to nearest even, overflow to inf
  const int exponent = std::max(std::ilogb(value), -14);
  const float rounded = std::ldexp(std::nearbyint(std::ldexp(value, 10 - exponent)), exponent - 10);
  return std::fabs(rounded) > 65504.0f ? std::copysign(std::numeric_limits<float>::infinity(), value) : rounded;
}

namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

bool EngineLayout::Trained(const Workload& w, int t) const {
  const int u = w.tensor_unit[t];
  return w.units[u].grad_padded_numel > 0 && (frozen_padded[u] == 0 || w.model.tensors[t].trainable);
}

EngineLayout LayoutOf(const Workload& w) {
  EngineLayout l;
  l.offset.assign(w.model.tensors.size(), 0);
  l.frozen_padded.assign(w.units.size(), 0);
  for (size_t u = 0; u < w.units.size(); ++u) {
    const WrapUnit& unit = w.units[u];
    l.frozen_padded[u] = unit.padded_numel - unit.grad_padded_numel;
    int64_t frozen = 0, trained = l.frozen_padded[u];
    for (int t : unit.tensors) {
      int64_t& next = l.Trained(w, t) ? trained : frozen;
      l.offset[t] = next;
      next += w.model.tensors[t].numel();
    }
  }
  return l;
}

std::vector<int64_t> ComputeOffsets(const Workload& w) {
  std::vector<int64_t> offsets(w.model.tensors.size(), -1);
  for (size_t u = 0; u < w.units.size(); ++u) {
    if (Nf4ComputeNumel(w.model, w.units[u].tensors) == 0) continue;
    int64_t next = 0;
    for (int t : w.units[u].tensors) {
      if (IsLoraAdapter(w.model.tensors[t].name)) continue;
      offsets[t] = next;
      next += w.model.tensors[t].LogicalNumel();
    }
  }
  return offsets;
}

namespace {

// Each tensor's random stream: its index among the model's own tensors (as without LoRA, so that a
// seeded LoRA run starts from the same base as a full one), adapters in streams of their own.
std::vector<uint64_t> SeedStreams(const Workload& w) {
  std::vector<uint64_t> streams(w.model.tensors.size());
  uint64_t own = 0, adapters = uint64_t{1} << 40;
  for (size_t t = 0; t < streams.size(); ++t) streams[t] = IsLoraAdapter(w.model.tensors[t].name) ? adapters++ : own++;
  return streams;
}

// Tensor t's seeded initial values (InitialUnit) into out (its LogicalNumel floats).
void InitialTensor(const Workload& w, int t, uint64_t stream, uint64_t seed, float* out) {
  std::mt19937_64 rng(seed * 7919 + stream);  // seeded per tensor: the same model whatever the wrapping
  const TensorSpec& ts = w.model.tensors[t];
  if (ts.name.ends_with(kLoraBSuffix)) {  // peft: nn.init.zeros_(lora_B)
    std::fill(out, out + ts.numel(), 0.0f);
  } else if (ts.name.ends_with(kLoraASuffix)) {  // peft: nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5)), a bound of 1 / sqrt(fan_in)
    const float bound = 1.0f / std::sqrt(static_cast<float>(ts.shape[1]));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (int64_t i = 0; i < ts.numel(); ++i) out[i] = uniform(rng);
  } else {
    std::normal_distribution<float> normal(0.0f, 0.02f);
    const bool norm = ts.shape.size() == 1;
    for (int64_t i = 0; i < ts.LogicalNumel(); ++i) out[i] = norm ? 1.0f : normal(rng);
  }
}

// Where a tensor's starting values are written: its place in the flat buffer or, for a QLoRA
// weight, its unquantized values, which Store then quantizes into that place.
class StartingTensor {
 public:
  StartingTensor(const Workload& w, int t, float* place) : w_(w), t_(t), place_(place) {
    if (w.model.tensors[t].nf4_numel > 0) logical_.resize(static_cast<size_t>(w.model.tensors[t].nf4_numel));
  }
  float* values() { return logical_.empty() ? place_ : logical_.data(); }
  // Nf4Quantize of the values as the storage dtype holds them, its bytes as storage elements
  void Store(std::vector<Nf4QuantState>* nf4_state) {
    if (logical_.empty()) return;
    const DType storage = FrozenStorageDtype(w_.config);
    for (float& v : logical_) v = RoundTo(v, storage);
    Nf4Weight q = Nf4Quantize(logical_.data(), static_cast<int64_t>(logical_.size()));
    const std::vector<float> elements = Nf4StorageElements(q.packed, storage);  // TensorSpec::numel() of them (CheckLoraSupported)
    std::copy(elements.begin(), elements.end(), place_);
    if (nf4_state) (*nf4_state)[static_cast<size_t>(t_)] = Nf4StateOf(std::move(q.absmax), w_.config.lora.double_quant);
  }

 private:
  const Workload& w_;
  int t_;
  float* place_;
  std::vector<float> logical_;
};
}  // namespace

std::vector<float> InitialUnit(const Workload& w, const EngineLayout& layout, int u, uint64_t seed, std::vector<Nf4QuantState>* nf4_state) {
  std::vector<float> flat(static_cast<size_t>(w.units[u].padded_numel), 0.0f);
  const std::vector<uint64_t> streams = SeedStreams(w);
  for (int t : w.units[u].tensors) {
    StartingTensor start(w, t, flat.data() + layout.offset[t]);
    InitialTensor(w, t, streams[static_cast<size_t>(t)], seed, start.values());
    start.Store(nf4_state);
  }
  return flat;
}

std::string CheckpointTensorName(const Checkpoint& checkpoint, const TensorSpec& tensor) {
  if (checkpoint.Has(tensor.name)) return tensor.name;
  if (IsLoraAdapter(tensor.name)) {  // peft's save_pretrained: "base_model.model.<name>" without the adapter name
    std::string saved = "base_model.model." + tensor.name;
    saved.erase(saved.rfind(".default."), 8);
    return checkpoint.Has(saved) ? saved : "";
  }
  std::string name = tensor.name;
  if (const size_t base = name.find(std::string(kLoraBaseLayer) + "."); base != std::string::npos) name.erase(base, kLoraBaseLayer.size());
  return name;
}

std::vector<CheckpointPiece> CheckpointPieces(const Checkpoint& checkpoint, const TensorSpec& tensor) {
  const std::string name = CheckpointTensorName(checkpoint, tensor);
  if (name.empty()) return {};
  const size_t dot = name.rfind('.');
  const std::string module = name.substr(0, dot + 1), leaf = name.substr(dot + 1);
  if (tensor.nf4_numel > 0) {  // a QLoRA weight's values in the checkpoint's shape ([out, in]) when it has as many
    const std::vector<int64_t> shape = checkpoint.ShapeOf(name);
    const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    return {{name, !shape.empty() && numel == tensor.nf4_numel ? shape : std::vector<int64_t>{tensor.nf4_numel}}};
  }
  const bool fused = tensor.shape.size() == 3 && (leaf == "gate_up_proj" || leaf == "down_proj");
  if (!fused || checkpoint.Has(name) || !checkpoint.Has(module + "0." + (leaf == "down_proj" ? "down_proj" : "gate_proj") + ".weight")) {
    return {{name, tensor.shape}};
  }
  std::vector<CheckpointPiece> pieces;
  const int64_t rows = leaf == "gate_up_proj" ? tensor.shape[1] / 2 : tensor.shape[1], cols = tensor.shape[2];
  for (int64_t e = 0; e < tensor.shape[0]; ++e) {
    const std::string expert = fmt::format("{}{}.", module, e);
    if (leaf == "down_proj") {
      pieces.push_back({expert + "down_proj.weight", {rows, cols}});
    } else {
      pieces.push_back({expert + "gate_proj.weight", {rows, cols}});
      pieces.push_back({expert + "up_proj.weight", {rows, cols}});
    }
  }
  return pieces;
}

Result<std::vector<float>> StartingUnit(const Workload& w, const EngineLayout& layout, int u, const TrainOptions& o,
                                        std::vector<Nf4QuantState>* nf4_state) {
  if (!o.checkpoint) return InitialUnit(w, layout, u, o.seed, nf4_state);
  std::vector<float> flat(static_cast<size_t>(w.units[u].padded_numel), 0.0f);
  const std::vector<uint64_t> streams = SeedStreams(w);
  for (int t : w.units[u].tensors) {
    const TensorSpec& ts = w.model.tensors[t];
    StartingTensor start(w, t, flat.data() + layout.offset[t]);
    const std::vector<CheckpointPiece> pieces = CheckpointPieces(*o.checkpoint, ts);
    if (pieces.empty()) InitialTensor(w, t, streams[static_cast<size_t>(t)], o.seed, start.values());  // an adapter the checkpoint does not have
    float* out = start.values();
    for (const CheckpointPiece& piece : pieces) {
      if (Status s = o.checkpoint->Read(piece.name, piece.shape, out); !s.ok()) return s.error();
      out += std::accumulate(piece.shape.begin(), piece.shape.end(), int64_t{1}, std::multiplies<>());
    }
    start.Store(nf4_state);
  }
  return flat;
}

MasterBuffer::MasterBuffer(DType dtype, size_t count, float value) : dtype_(dtype) {
  if (dtype_ == DType::kBf16) bf16_.assign(count, 0);
  else fp32_.assign(count, value);
  for (size_t i = 0; dtype_ == DType::kBf16 && value != 0.0f && i < count; ++i) Set(i, value);
}

float MasterBuffer::Get(size_t i) const {
  if (dtype_ != DType::kBf16) return fp32_[i];
  const uint32_t bits = static_cast<uint32_t>(bf16_[i]) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

void MasterBuffer::Set(size_t i, float value) {
  if (dtype_ != DType::kBf16) {
    fp32_[i] = RoundTo(value, dtype_);
    return;
  }
  const float rounded = RoundTo(value, DType::kBf16);
  uint32_t bits;
  std::memcpy(&bits, &rounded, 4);
  bf16_[i] = static_cast<uint16_t>(bits >> 16);
}

void MasterBuffer::Release() {
  std::vector<float>().swap(fp32_);
  std::vector<uint16_t>().swap(bf16_);
}

AdamWScalars AdamWStepScalars(const TrainOptions& o, int64_t steps_taken) {
  const double t = static_cast<double>(steps_taken + 1);
  return {.decay = static_cast<float>(1 - o.lr * o.weight_decay),
          .lerp_weight = static_cast<float>(1 - o.beta1),
          .beta2 = static_cast<float>(o.beta2),
          .one_minus_beta2 = static_cast<float>(1 - o.beta2),
          .bias2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(o.beta2, t))),
          .eps = static_cast<float>(o.eps),
          .step_size = static_cast<float>(-(o.lr / (1 - std::pow(o.beta1, t))))};
}

void AdamWUpdate(const AdamWScalars& s, DType dtype, float g, float& p, float& m, float& v) {
  auto r = [dtype](float x) { return RoundTo(x, dtype); };
  p = r(p * s.decay);                                                                        // param.mul_(1 - lr * wd)
  // exp_avg.lerp_(grad, 1 - beta1): ATen's lerp_vec, one fused multiply-add from the nearer end
  const bool small = std::fabs(s.lerp_weight) < 0.5f;
  m = r(std::fma(small ? s.lerp_weight : s.lerp_weight - 1.0f, g - m, small ? m : g));
  v = r(v * s.beta2);                                                                        // exp_avg_sq.mul_(beta2)
  v = r(v + s.one_minus_beta2 * g * g);                                                      // .addcmul_(grad, grad, value=1 - beta2)
  float d = r(std::sqrt(v));                                                                 // exp_avg_sq.sqrt()
  d = r(d / s.bias2_sqrt);                                                                   // / bias_correction2_sqrt
  d = r(d + s.eps);                                                                          // .add_(eps)
  p = r(p + s.step_size * m / d);                                                            // param.addcdiv_(exp_avg, denom, value=-step_size)
}

AdamCorrections AdamBiasCorrections(const TrainOptions& o, int64_t steps_taken) {
  const float t = static_cast<float>(steps_taken + 1);
  return {static_cast<float>(1 - std::pow(o.beta1, t)), static_cast<float>(1 - std::pow(o.beta2, t))};
}

Status CheckEveryParameterTrains(const Workload& w) {
  for (const TensorSpec& t : w.model.tensors) {
    if (!t.trainable) {
      return Error::BadInput(fmt::format("fsdp-run's GPU engine trains every parameter; {} is frozen (LoRA and QLoRA train on --device cpu)", t.name));
    }
  }
  return {};
}

uint64_t ConfigFingerprint(const Workload& w, const TrainOptions& o) {
  const FsdpConfig& c = w.config;
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t v : {w.model.ParamsTotal(), c.gpus, c.seq_len, c.micro_batch, c.grad_accum, static_cast<int64_t>(c.strategy),
                    static_cast<int64_t>(c.checkpointing), static_cast<int64_t>(c.param_dtype), static_cast<int64_t>(c.reduce_dtype),
                    static_cast<int64_t>(c.framework), static_cast<int64_t>(c.master_dtype), static_cast<int64_t>(c.wrap),
                    static_cast<int64_t>(c.use_orig_params), c.lora.rank, w.model.ParamsTrainable()}) {
    mix(static_cast<uint64_t>(v));
  }
  mix(std::hash<double>{}(c.lora.alpha));
  mix(std::hash<double>{}(c.lora.dropout));
  mix(std::hash<std::string>{}(c.lora.targets));
  mix(static_cast<uint64_t>(FrozenStorageDtype(c)));
  mix(static_cast<uint64_t>(c.lora.qlora) * 2 + static_cast<uint64_t>(c.lora.double_quant));
  mix(static_cast<uint64_t>(QloraComputeDtype(c)));
  mix(o.seed);
  mix(o.checkpoint ? o.checkpoint->Fingerprint() : 0);
  mix(static_cast<uint64_t>(o.loss_scaling.mode));
  mix(static_cast<uint64_t>(o.loss_scaling.init_scale));
  mix(static_cast<uint64_t>(o.loss_scaling.growth_interval));
  return h;
}

// What of LoRA the CPU engine implements: FSDP2's per-parameter gradients, FSDP1's flat parameters
// with use_orig_params under block or whole-model wrapping, the base in a dtype of its own, dropout,
// QLoRA's NF4 weights, double-quantized or not.
Status CheckLoraSupported(const Workload& w) {
  const LoraConfig& l = w.config.lora;
  if (l.rank == 0) return CheckEveryParameterTrains(w);
  if (l.qlora) {
    const DType storage = FrozenStorageDtype(w.config);
    if (storage == DType::kFp16) return Error::BadInput("fsdp-run packs QLoRA's NF4 weights into bf16 or fp32 elements (the param dtype): --param-dtype fp16 is planned only");
    for (const TensorSpec& t : w.model.tensors) {  // packed.view(quant_storage) needs whole elements
      if (t.nf4_numel > 0 && t.nf4_numel % (2 * BytesPerElement(storage)) != 0) {
        return Error::BadInput(fmt::format("{}: {} NF4 values do not fill whole {} elements", t.name, t.nf4_numel, DTypeName(storage)));
      }
    }
  }
  if (w.config.framework == Framework::kFsdp1 && w.config.wrap == WrapPolicy::kPeft) {  // FSDP1's mixed units need use_orig_params (BuildWorkload)
    return Error::BadInput("fsdp-run wraps per block or the whole model: for LoRA under FSDP1 pass --wrap block --use-orig-params "
                           "(peft's wrap, each adapter a unit of its own, is planned only), or --framework fsdp2");
  }
  return {};
}

Result<std::unique_ptr<FsdpEngine>> FsdpEngine::Create(const Workload& w, Comm& world, const TrainOptions& o) {
  auto dims = DimsOf(w.model, w.config.seq_len);
  if (!dims.ok()) return dims.error();
  if (Status s = CheckLoraSupported(w); !s.ok()) return s.error();
  if (w.config.wrap != WrapPolicy::kBlock && w.config.wrap != WrapPolicy::kNone) {
    return Error::BadInput("fsdp-run wraps per block (--wrap block) or the whole model (--wrap none)");
  }
  if (world.size() != w.config.gpus) {
    return Error::BadInput(fmt::format("--gpus {} but {} ranks are running (start as many ranks as --gpus)", w.config.gpus, world.size()));
  }
  if (Status s = CheckLossScalerOptions(o.loss_scaling); !s.ok()) return s.error();
  if (Status s = world.CheckSame(ConfigFingerprint(w, o), "configurations"); !s.ok()) return s.error();
  std::unique_ptr<FsdpEngine> e(new FsdpEngine(w, world, o));
  e->dims_ = dims.value();
  e->layout_ = LayoutOf(w);
  e->compute_offset_ = ComputeOffsets(w);
  if (w.config.lora.rank > 0) {
    e->dims_.lora_scale = static_cast<float>(w.config.lora.alpha / static_cast<double>(w.config.lora.rank));
    e->dims_.lora_dropout = w.config.lora.dropout;
    // a block's own tensors where Params finds them: its compute buffer under QLoRA, else the gathered unit
    const FsdpEngine& engine = *e;
    SetBlockLayout(w.model, [&engine](int t) { return engine.compute_offset_[t] >= 0 ? engine.compute_offset_[t] : engine.layout_.offset[t]; },
                   e->dims_);
  }
  if (Status s = e->Init(); !s.ok()) return s.error();
  return e;
}

Status FsdpEngine::Init() {
  shard_world_ = w_.shard_world;
  const int rank = world_.rank();
  auto shard = world_.Split(rank / static_cast<int>(shard_world_), rank);
  if (!shard.ok()) return shard.error();
  shard_comm_ = std::move(shard).value();
  auto replica = world_.Split(rank % static_cast<int>(shard_world_), rank);
  if (!replica.ok()) return replica.error();
  replica_comm_ = std::move(replica).value();
  const size_t n = w_.units.size();
  shard_.resize(n);
  grad_shard_.resize(n);
  exp_avg_.resize(n);
  exp_avg_sq_.resize(n);
  stepped_.resize(n);
  full_.resize(n);
  full_grad_.resize(n);
  compute_.resize(n);
  nf4_state_.resize(w_.model.tensors.size());
  first_adapter_.assign(w_.nodes.size(), -1);
  for (size_t t = 0; t < w_.model.tensors.size(); ++t) {  // a block's first lora_A: where its adapters start
    const TensorSpec& ts = w_.model.tensors[t];
    for (size_t i = 0; ts.block >= 0 && ts.name.ends_with(kLoraASuffix) && i < w_.nodes.size(); ++i) {
      if (w_.nodes[i].role == ModuleNode::Role::kBlock && w_.nodes[i].block == ts.block && first_adapter_[i] < 0) first_adapter_[i] = static_cast<int>(t);
    }
  }
  const int shard_rank = shard_comm_->rank();
  for (size_t u = 0; u < n; ++u) {
    const WrapUnit& unit = w_.units[u];
    auto start = StartingUnit(w_, layout_, static_cast<int>(u), o_, &nf4_state_);
    if (!start.ok()) return start.error();
    const std::vector<float>& flat = start.value();
    // each group's shard: [frozen shard F/W | trained shard G/W]
    const int64_t f = layout_.frozen_padded[u] / shard_world_, g = unit.grad_shard_numel;
    if (f + g != unit.shard_numel) {  // EngineLayout's invariant, which Unshard's two all-gathers rely on
      return Error::RunFailed(fmt::format("unit {}: frozen {} + trained {} elements are not its shard of {}", unit.name, f, g, unit.shard_numel));
    }
    const DType master = w_.config.master_dtype;
    shard_[u] = ShardBuffer(FrozenStorageDtype(w_.config), static_cast<size_t>(f), master, static_cast<size_t>(g));
    for (int64_t i = 0; i < f; ++i) shard_[u].Set(static_cast<size_t>(i), flat[static_cast<size_t>(shard_rank * f + i)]);
    const int64_t trained = layout_.frozen_padded[u] + shard_rank * g;
    for (int64_t i = 0; i < g; ++i) shard_[u].Set(static_cast<size_t>(f + i), flat[static_cast<size_t>(trained + i)]);
    stepped_[u] = SteppedShardRuns(w_, static_cast<int>(u), shard_rank);
    int64_t states = 0;  // AdamW's, for the elements it steps
    for (const ElementRun& run : stepped_[u]) states += run.numel;
    exp_avg_[u] = MasterBuffer(master, static_cast<size_t>(states));
    exp_avg_sq_[u] = MasterBuffer(master, static_cast<size_t>(states));
    ledger_.Add(MemCategory::kShardedParams, shard_[u].Bytes());
    ledger_.Add(MemCategory::kOptimizerStates, exp_avg_[u].Bytes() + exp_avg_sq_[u].Bytes());
  }
  for (const Nf4QuantState& state : nf4_state_) ledger_.Add(MemCategory::kShardedParams, state.Bytes());
  return ledger_.Sample();
}

Status FsdpEngine::WaitFor(size_t index) {
  Status s;
  for (int handle : in_flight_[index].handles) {
    if (Status w = shard_comm_->Wait(handle); s.ok() && !w.ok()) s = w;
  }
  ledger_.Sub(MemCategory::kCommBuffers, static_cast<int64_t>(in_flight_[index].low.size()) * 4);
  const int u = in_flight_[index].unit;
  in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(index));
  if (s.ok()) Dequantize(u);
  return s;
}

Status FsdpEngine::Unshard(int u, bool prefetch) {
  if (!full_[u].empty()) return {};
  const WrapUnit& unit = w_.units[u];
  InFlight f{u, std::vector<float>(shard_[u].size()), {}};
  for (size_t i = 0; i < f.low.size(); ++i) f.low[i] = RoundTo(shard_[u].Get(i), w_.config.param_dtype);
  ledger_.Add(MemCategory::kCommBuffers, unit.shard_numel * 4);
  full_[u].resize(static_cast<size_t>(unit.padded_numel));
  ledger_.Add(MemCategory::kUnshardedParams, unit.padded_numel * 4);
  // one all-gather per group: the frozen one into [0, F), the trained one into [F, F + G)
  const int64_t frozen = layout_.frozen_padded[u] / shard_world_, groups[2][2] = {{0, frozen}, {frozen, unit.shard_numel - frozen}};
  if (!prefetch || w_.config.strategy == Strategy::kNoShard) {  // NO_SHARD's copy is local: done at once
    Status s = ledger_.Sample();
    for (const auto& [first, numel] : groups) {
      if (s.ok() && numel > 0) s = shard_comm_->AllGather(f.low.data() + first, full_[u].data() + first * shard_world_, numel);
    }
    ledger_.Sub(MemCategory::kCommBuffers, unit.shard_numel * 4);
    if (s.ok()) Dequantize(u);
    return s;
  }
  in_flight_.push_back(std::move(f));
  for (const auto& [first, numel] : groups) {
    if (numel == 0) continue;
    auto handle = shard_comm_->StartAllGather(in_flight_.back().low.data() + first, full_[u].data() + first * shard_world_, numel);
    if (!handle.ok()) return handle.error();
    in_flight_.back().handles.push_back(handle.value());
  }
  return ledger_.Sample();
}

Status FsdpEngine::WaitUnshard(int u) {
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    if (in_flight_[i].unit == u) return WaitFor(i);
  }
  return {};
}

void FsdpEngine::Dequantize(int u) {
  const int64_t numel = Nf4ComputeNumel(w_.model, w_.units[u].tensors);
  if (numel == 0) return;
  compute_[u].resize(static_cast<size_t>(numel));
  ledger_.Add(MemCategory::kUnshardedParams, numel * 4);
  const DType storage = FrozenStorageDtype(w_.config), compute = QloraComputeDtype(w_.config);
  for (int t : w_.units[u].tensors) {
    if (compute_offset_[t] < 0) continue;  // an adapter: Params reads it from full_
    const TensorSpec& ts = w_.model.tensors[t];
    const float* gathered = full_[u].data() + layout_.offset[t];
    float* out = compute_[u].data() + compute_offset_[t];
    if (ts.nf4_numel == 0) {
      // Linear4bit.forward casts a quantized linear's bias to the compute dtype (AddOp puts it right after the weight)
      const bool nf4_bias = t > 0 && w_.model.tensors[t - 1].nf4_numel > 0 && ts.module() == w_.model.tensors[t - 1].module();
      for (int64_t i = 0; i < ts.numel(); ++i) out[i] = nf4_bias ? RoundTo(gathered[i], compute) : gathered[i];
      continue;
    }
    // MatMul4Bit's dequantize_4bit(B, quant_state).to(A.dtype), A cast to bnb_4bit_compute_dtype:
    // fp32 products, then the compute dtype
    const std::vector<uint8_t> packed = Nf4PackedBytes(gathered, ts.numel(), storage);  // (n / 2 bytes, gone before any sample)
    const Nf4QuantState& state = nf4_state_[t];
    const std::vector<float> nested = state.absmax_q.empty() ? std::vector<float>() : state.Absmax();  // double-quantized: for this product
    Nf4Dequantize(packed.data(), state.absmax_q.empty() ? state.absmax.data() : nested.data(), ts.nf4_numel, out);
    for (int64_t i = 0; i < ts.nf4_numel; ++i) out[i] = RoundTo(out[i], compute);
  }
}

void FsdpEngine::Reshard(int u) {
  ledger_.Sub(MemCategory::kUnshardedParams, static_cast<int64_t>(full_[u].size() + compute_[u].size()) * 4);
  std::vector<float>().swap(full_[u]);
  std::vector<float>().swap(compute_[u]);
}

// Reduce-scatter the unit's gradient (rounded to reduce_dtype) within the shard group, all-reduce
// the shard across replicas, average over the world, accumulate into the gradient shard (master dtype).
Status FsdpEngine::Reduce(int u) {
  std::vector<float>& g = full_grad_[u];
  for (float& v : g) v = RoundTo(v, w_.config.reduce_dtype);
  const int64_t numel = w_.units[u].grad_shard_numel;  // the trained group's shard
  if (numel == 0) return {};  // nothing of the unit trains
  std::vector<float> shard(static_cast<size_t>(numel));
  ledger_.Add(MemCategory::kCommBuffers, numel * 4);
  if (grad_shard_[u].empty()) {  // allocated before the sample, so that the heap holds what the ledger counts
    grad_shard_[u] = MasterBuffer(w_.config.master_dtype, shard.size());
    ledger_.Add(MemCategory::kGradients, grad_shard_[u].Bytes());
  }
  if (Status st = ledger_.Sample(); !st.ok()) return st;
  if (Status s = shard_comm_->ReduceScatter(g.data(), shard.data(), numel); !s.ok()) return s;
  if (replica_comm_->size() > 1) {
    if (Status s = replica_comm_->AllReduce(shard.data(), static_cast<int64_t>(shard.size())); !s.ok()) return s;
  }
  // the mean over the world's micro-batches, unscaled (S a power of two: exact)
  const float scale = 1.0f / (static_cast<float>(world_.size() * w_.config.grad_accum) * scaler_.scale());
  for (size_t i = 0; i < shard.size(); ++i) grad_shard_[u].Set(i, grad_shard_[u].Get(i) + shard[i] * scale);
  ledger_.Sub(MemCategory::kCommBuffers, numel * 4);
  ledger_.Sub(MemCategory::kGradients, static_cast<int64_t>(g.size()) * 4);
  std::vector<float>().swap(g);
  return {};
}

int64_t FirstSequence(const Workload& w, int64_t step, int64_t micro, int rank, int world) {
  return ((step * w.config.grad_accum + micro) * world + rank) * w.config.micro_batch;
}

std::vector<int32_t> TrainingTokens(const Workload& w, const TrainOptions& o, int64_t step, int64_t micro, int rank, int world) {
  const int64_t vocab = w.model.vocab_size;
  const int64_t seq = w.config.seq_len, mb = w.config.micro_batch;
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(mb * (seq + 1)));
  for (int64_t i = 0; i < mb; ++i) {
    const int64_t sequence = FirstSequence(w, step, micro, rank, world) + i;  // seq + 1 tokens each
    if (!o.tokens.empty()) {  // consecutive windows of seq + 1 tokens from the file, cycled
      const int64_t n = static_cast<int64_t>(o.tokens.size());
      for (int64_t j = 0; j <= seq; ++j) tokens.push_back(o.tokens[static_cast<size_t>((sequence * (seq + 1) + j) % n)]);
      continue;
    }
    std::mt19937_64 rng(o.seed * 1000003ULL + static_cast<uint64_t>(sequence));
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
    // a random start, then a fixed recurrence the model can learn: t' = (5 t + 3) mod V
    int64_t t = token(rng);
    for (int64_t j = 0; j <= seq; ++j) {
      tokens.push_back(static_cast<int32_t>(t));
      t = (5 * t + 3) % vocab;
    }
  }
  return tokens;
}

// One micro-batch's tensors as the schedule's segments pass them on.
struct FsdpEngine::Pass {
  std::vector<int32_t> inputs, targets;
  DropoutKey dropout;              // LoRA dropout's masks: this micro-batch's sequences (block set per call)
  Mat x;                           // the hidden state: forward through the blocks, then the gradient back
  std::vector<BlockCache> caches;  // per block
  std::vector<Mat> inputs_saved;   // per block, under --ac full
  Vec inv;                         // the final norm's inverse RMS
  Mat final_x, normed, d_logits, d_normed;
  float loss = 0;
  int64_t head_bytes = 0;
};

// A block's own tensors start at its first tensor (Workload::WeightTensor: a tied lm_head's is the
// embedding's), its adapters at the first of theirs (block 0's layout: LlamaDims).

bool FsdpEngine::Trains(int node) const { return w_.model.tensors[w_.WeightTensor(node)].trainable; }

BlockWeights FsdpEngine::Params(int node) const {
  const int t = w_.WeightTensor(node), a = first_adapter_[node];
  const int u = w_.tensor_unit[t];
  const float* full = full_[u].data();
  const float* base = compute_offset_[t] >= 0 ? compute_[u].data() + compute_offset_[t] : full + layout_.offset[t];
  return BlockWeights(base, a >= 0 ? full + layout_.offset[a] : nullptr);
}

BlockGrads FsdpEngine::Grads(int node) {
  const int t = w_.WeightTensor(node), a = first_adapter_[node];
  const int u = w_.tensor_unit[t];
  if (w_.units[u].grad_padded_numel == 0) return BlockGrads(nullptr);
  if (full_grad_[u].empty()) {  // under no_sync it holds the earlier micro-batches' gradients
    full_grad_[u].assign(static_cast<size_t>(w_.units[u].grad_padded_numel), 0.0f);
    ledger_.Add(MemCategory::kGradients, w_.units[u].grad_padded_numel * 4);
  }
  auto at = [&](int tensor) { return full_grad_[u].data() + (layout_.offset[tensor] - layout_.frozen_padded[u]); };  // the trained group starts at F_u
  return BlockGrads(layout_.Trained(w_, t) ? at(t) : nullptr, a >= 0 ? at(a) : nullptr);
}

namespace {
// Where block `block`'s LoRA dropout masks come from in a micro-batch (its recompute's too).
DropoutKey BlockDropout(const DropoutKey& micro_batch, int block) {
  DropoutKey key = micro_batch;
  key.block = block;
  return key;
}
}  // namespace

Status FsdpEngine::ForwardNode(int node, Pass& p) {
  const int64_t seq = w_.config.seq_len, mb = w_.config.micro_batch, h = dims_.hidden, vocab = dims_.vocab;
  switch (w_.nodes[node].role) {
    case ModuleNode::Role::kEmbedding: p.x = EmbeddingForward(ConstMatMap(Params(node).base, vocab, h), p.inputs); return {};
    case ModuleNode::Role::kBlock: {
      const int b = w_.nodes[node].block;
      const bool ac = w_.config.checkpointing == Checkpointing::kFull;
      if (ac) {
        p.inputs_saved[b] = p.x;
        ledger_.Add(MemCategory::kActivations, p.x.size() * 4);
      }
      p.x = BlockForward(dims_, Params(node), p.x, mb, seq, ac ? nullptr : &p.caches[b], BlockDropout(p.dropout, b));
      if (w_.config.checkpointing == Checkpointing::kSelective) DropAttentionCore(p.caches[b]);  // recomputed in backward
      if (!ac) ledger_.Add(MemCategory::kActivations, p.caches[b].SavedBytes());
      return ledger_.Sample();
    }
    case ModuleNode::Role::kFinalNorm:
      p.final_x = std::move(p.x);
      p.normed = RmsNormForward(p.final_x, Eigen::Map<const Vec>(Params(node).base, h), dims_.rms_eps, p.inv);
      return {};
    case ModuleNode::Role::kLmHead: {
      const Mat logits = LinearForward(p.normed, ConstMatMap(Params(node).base, vocab, h));
      p.loss = CrossEntropy(logits, p.targets, p.d_logits);
      if (scaler_.enabled()) p.d_logits *= scaler_.scale();  // GradScaler.scale(loss).backward()
      // d_logits, the normed input and the final norm's input stay to the embedding's backward; the
      // logits themselves die with this scope, after the sample
      const int64_t logits_bytes = logits.size() * 4;
      p.head_bytes = (p.d_logits.size() + p.normed.size() + p.final_x.size()) * 4;
      ledger_.Add(MemCategory::kActivations, p.head_bytes + logits_bytes);
      const Status sampled = ledger_.Sample();
      ledger_.Sub(MemCategory::kActivations, logits_bytes);
      return sampled;
    }
    case ModuleNode::Role::kOther: return {};
  }
  return {};
}

Status FsdpEngine::BackwardNode(int node, Pass& p) {
  const int64_t seq = w_.config.seq_len, mb = w_.config.micro_batch, h = dims_.hidden, vocab = dims_.vocab;
  switch (w_.nodes[node].role) {
    case ModuleNode::Role::kLmHead: {
      const ConstMatMap w(Params(node).base, vocab, h);
      if (!Trains(node)) {  // frozen (LoRA): the input's gradient only
        p.d_normed = p.d_logits * w;
        return {};
      }
      MatMap g(Grads(node).base, vocab, h);
      p.d_normed = LinearBackward(p.d_logits, p.normed, w, g);
      return {};
    }
    case ModuleNode::Role::kFinalNorm: {
      Vec frozen = Vec::Zero(Trains(node) ? 0 : h);  // a frozen norm's weight gradient is dropped
      Eigen::Map<Vec> g_norm(Trains(node) ? Grads(node).base : frozen.data(), h);
      p.x = RmsNormBackward(p.d_normed, p.final_x, Eigen::Map<const Vec>(Params(node).base, h), p.inv, g_norm);
      return {};
    }
    case ModuleNode::Role::kBlock: {
      const int b = w_.nodes[node].block;
      const bool ac = w_.config.checkpointing == Checkpointing::kFull;
      const BlockGrads grads = Grads(node);
      if (ac) {
        BlockForward(dims_, Params(node), p.inputs_saved[b], mb, seq, &p.caches[b], BlockDropout(p.dropout, b));  // the forward's masks again
        ledger_.Add(MemCategory::kActivations, p.caches[b].SavedBytes());
      }
      if (w_.config.checkpointing == Checkpointing::kSelective) ledger_.Add(MemCategory::kActivations, RecomputeAttentionCore(dims_, p.caches[b], mb, seq));
      p.x = BlockBackward(dims_, Params(node), grads, p.x, p.caches[b], mb, seq);
      ledger_.Add(MemCategory::kActivations, p.x.size() * 4);  // the gradient flowing back, live at the sample
      const Status sampled = ledger_.Sample();
      ledger_.Sub(MemCategory::kActivations, p.x.size() * 4);
      if (!sampled.ok()) return sampled;
      ledger_.Sub(MemCategory::kActivations, p.caches[b].SavedBytes());
      p.caches[b] = BlockCache();
      if (ac) {
        ledger_.Sub(MemCategory::kActivations, p.inputs_saved[b].size() * 4);
        p.inputs_saved[b] = Mat();
      }
      return {};
    }
    case ModuleNode::Role::kEmbedding: {
      if (Trains(node)) {
        MatMap g_embed(Grads(node).base, vocab, h);
        EmbeddingBackward(p.x, p.inputs, g_embed);
      }
      ledger_.Sub(MemCategory::kActivations, p.head_bytes);
      p.d_logits = Mat();
      p.normed = Mat();
      p.final_x = Mat();
      return {};
    }
    case ModuleNode::Role::kOther: return {};
  }
  return {};
}

// Plays the micro-batch's schedule: hooks unshard, reshard and reduce; segments run the modules.
Result<float> FsdpEngine::MicroBatch(int64_t step, int64_t micro) {
  auto pass_start = std::chrono::steady_clock::now();
  const int64_t seq = w_.config.seq_len, mb = w_.config.micro_batch;
  Pass p;
  const std::vector<int32_t> all = TrainingTokens(w_, o_, step, micro, world_.rank(), world_.size());
  p.dropout = {.seed = o_.seed, .first_sequence = FirstSequence(w_, step, micro, world_.rank(), world_.size())};
  for (int64_t i = 0; i < mb; ++i) {
    p.inputs.insert(p.inputs.end(), all.begin() + i * (seq + 1), all.begin() + i * (seq + 1) + seq);
    p.targets.insert(p.targets.end(), all.begin() + i * (seq + 1) + 1, all.begin() + (i + 1) * (seq + 1));
  }
  p.caches.resize(static_cast<size_t>(dims_.layers));
  p.inputs_saved.resize(static_cast<size_t>(dims_.layers));
  phases_.StartMicroBatch(static_cast<int>(micro));
  for (const Action& a : schedule_.MicroBatch(micro)) {
    if (phases_.Enter(a)) ledger_.set_phase(phases_.phase());
    Status s;
    switch (a.kind) {
      case ActionKind::kUnshard: s = Unshard(a.unit, a.prefetch); break;
      case ActionKind::kWaitUnshard: s = WaitUnshard(a.unit); break;
      case ActionKind::kForward:
      case ActionKind::kBackward:
        for (const NodeVisit& v : schedule_.Visits(schedule_.segments()[a.segment])) {
          if (phases_.Enter(v, a.kind == ActionKind::kForward)) ledger_.set_phase(phases_.phase());
          if (a.kind == ActionKind::kForward) s = ForwardNode(v.node, p);
          else if (v.enter) s = BackwardNode(v.node, p);
          if (!s.ok()) break;
        }
        break;
      case ActionKind::kReshard: Reshard(a.unit); break;
      case ActionKind::kReduce: s = Reduce(a.unit); break;
      case ActionKind::kEndForward:
        times_.forward_s += Seconds(pass_start);
        pass_start = std::chrono::steady_clock::now();
        break;
      case ActionKind::kEndBackward: times_.backward_s += Seconds(pass_start); break;
      case ActionKind::kPreForward:
      case ActionKind::kPostForward:
      case ActionKind::kPreBackward:
      case ActionKind::kPostBackward:
      case ActionKind::kOptimizer: break;  // Step runs the optimizer after the last micro-batch
    }
    if (!s.ok()) return s.error();
  }
  return p.loss;
}

Result<bool> FsdpEngine::FoundNonFinite() {
  const bool here = std::any_of(grad_shard_.begin(), grad_shard_.end(), [](const MasterBuffer& g) {
    for (size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g.Get(i))) return true;
    }
    return false;
  });
  float found = here ? 1.0f : 0.0f;
  if (Status s = world_.AllReduce(&found, 1); !s.ok()) return s.error();
  return found > 0.0f;
}

Status FsdpEngine::Optimizer() {
  const auto start = std::chrono::steady_clock::now();
  if (Status st = ledger_.Sample(); !st.ok()) return st;
  auto allowed = scaler_.CheckAndUpdate([this] { return FoundNonFinite(); });
  if (!allowed.ok()) return allowed.error();
  const bool apply = allowed.value();
  const AdamWScalars scalars = AdamWStepScalars(o_, optimizer_steps_);
  const DType master = w_.config.master_dtype;
  for (size_t u = 0; u < shard_.size(); ++u) {
    // the trained group's shard, after the frozen group's F_u / W elements
    const size_t trained = static_cast<size_t>(layout_.frozen_padded[u] / shard_world_);
    size_t state = 0;  // the states are packed over the stepped runs
    for (const ElementRun& run : stepped_[u]) {
      for (int64_t i = run.first; apply && !grad_shard_[u].empty() && i < run.first + run.numel; ++i, ++state) {
        const size_t at = trained + static_cast<size_t>(i);
        float p = shard_[u].Get(at), m = exp_avg_[u].Get(state), v = exp_avg_sq_[u].Get(state);
        AdamWUpdate(scalars, master, grad_shard_[u].Get(static_cast<size_t>(i)), p, m, v);
        shard_[u].Set(at, p);
        exp_avg_[u].Set(state, m);
        exp_avg_sq_[u].Set(state, v);
      }
    }
    ledger_.Sub(MemCategory::kGradients, grad_shard_[u].Bytes());
    grad_shard_[u].Release();  // zero_grad(set_to_none=True)
  }
  if (apply) ++optimizer_steps_;
  times_.optimizer_s += Seconds(start);
  return {};
}

Result<float> FsdpEngine::Step(int64_t step) {
  double loss_sum = 0;
  for (int64_t m = 0; m < w_.config.grad_accum; ++m) {
    auto loss = MicroBatch(step, m);
    if (!loss.ok()) return loss.error();
    loss_sum += loss.value();
  }
  if (Status s = Optimizer(); !s.ok()) return s.error();
  float mean = static_cast<float>(loss_sum / static_cast<double>(w_.config.grad_accum));
  if (Status s = world_.AllReduce(&mean, 1); !s.ok()) return s.error();
  return mean / static_cast<float>(world_.size());
}

}  // namespace fsdp::runtime
