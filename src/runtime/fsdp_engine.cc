#include "runtime/fsdp_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <fmt/format.h>

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

std::vector<float> InitialUnit(const Workload& w, int u, uint64_t seed) {
  const WrapUnit& unit = w.units[u];
  std::vector<float> flat(static_cast<size_t>(unit.padded_numel), 0.0f);
  size_t offset = 0;
  for (int t : unit.tensors) {  // seeded per tensor: the same model whatever the wrapping
    std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(t));
    std::normal_distribution<float> normal(0.0f, 0.02f);
    const TensorSpec& ts = w.model.tensors[t];
    const bool norm = ts.shape.size() == 1;
    for (int64_t i = 0; i < ts.numel(); ++i) flat[offset + i] = norm ? 1.0f : normal(rng);
    offset += static_cast<size_t>(ts.numel());
  }
  return flat;
}

Result<std::vector<float>> StartingUnit(const Workload& w, int u, const TrainOptions& o) {
  if (!o.checkpoint) return InitialUnit(w, u, o.seed);
  std::vector<float> flat(static_cast<size_t>(w.units[u].padded_numel), 0.0f);
  int64_t offset = 0;
  for (int t : w.units[u].tensors) {
    const TensorSpec& ts = w.model.tensors[t];
    if (Status s = o.checkpoint->Read(ts.name, ts.shape, flat.data() + offset); !s.ok()) return s.error();
    offset += ts.numel();
  }
  return flat;
}

AdamCorrections AdamBiasCorrections(const TrainOptions& o, int64_t steps_taken) {
  const float t = static_cast<float>(steps_taken + 1);
  return {1.0f - std::pow(o.beta1, t), 1.0f - std::pow(o.beta2, t)};
}

uint64_t ConfigFingerprint(const Workload& w, const TrainOptions& o) {
  const FsdpConfig& c = w.config;
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t v : {w.model.ParamsTotal(), c.gpus, c.seq_len, c.micro_batch, c.grad_accum, static_cast<int64_t>(c.strategy),
                    static_cast<int64_t>(c.checkpointing), static_cast<int64_t>(c.param_dtype), static_cast<int64_t>(c.reduce_dtype)}) {
    mix(static_cast<uint64_t>(v));
  }
  mix(o.seed);
  mix(o.checkpoint ? o.checkpoint->Fingerprint() : 0);
  mix(static_cast<uint64_t>(o.loss_scaling.mode));
  mix(static_cast<uint64_t>(o.loss_scaling.init_scale));
  mix(static_cast<uint64_t>(o.loss_scaling.growth_interval));
  return h;
}

Result<std::unique_ptr<FsdpEngine>> FsdpEngine::Create(const Workload& w, Comm& world, const TrainOptions& o) {
  auto dims = DimsOf(w.model, w.config.seq_len);
  if (!dims.ok()) return dims.error();
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
  full_.resize(n);
  full_grad_.resize(n);
  const int shard_rank = shard_comm_->rank();
  for (size_t u = 0; u < n; ++u) {
    const int64_t s = w_.units[u].shard_numel;
    auto start = StartingUnit(w_, static_cast<int>(u), o_);
    if (!start.ok()) return start.error();
    const std::vector<float>& flat = start.value();
    shard_[u].assign(flat.begin() + shard_rank * s, flat.begin() + (shard_rank + 1) * s);
    exp_avg_[u].assign(static_cast<size_t>(s), 0.0f);
    exp_avg_sq_[u].assign(static_cast<size_t>(s), 0.0f);
    ledger_.Add(Mem::kShardedParams, s * 4);
    ledger_.Add(Mem::kOptimizerStates, 2 * s * 4);
  }
  if (Status st = ledger_.Sample("initialisation"); !st.ok()) return st;
  block_unit_ = w_.BlockUnits();
  return {};
}

bool FsdpEngine::ReshardAfterForward(int u) const {
  if (w_.units[u].is_root) return false;
  return w_.config.strategy == Strategy::kFullShard || w_.config.strategy == Strategy::kHybridShard;
}

Status FsdpEngine::WaitFor(size_t index) {
  Status s = shard_comm_->Wait(in_flight_[index].handle);
  ledger_.Sub(Mem::kCommBuffers, static_cast<int64_t>(in_flight_[index].low.size()) * 4);
  in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(index));
  return s;
}

Status FsdpEngine::Prefetch(int u) {
  if (u < 0 || !full_[u].empty() || w_.config.strategy == Strategy::kNoShard) return {};
  const size_t limit = w_.config.limit_all_gathers ? 2 : SIZE_MAX;
  while (in_flight_.size() >= limit) {
    if (Status s = WaitFor(0); !s.ok()) return s;
  }
  const WrapUnit& unit = w_.units[u];
  InFlight f{u, std::vector<float>(shard_[u].size()), -1};
  for (size_t i = 0; i < f.low.size(); ++i) f.low[i] = RoundTo(shard_[u][i], w_.config.param_dtype);
  ledger_.Add(Mem::kCommBuffers, unit.shard_numel * 4);
  full_[u].resize(static_cast<size_t>(unit.padded_numel));
  ledger_.Add(Mem::kUnshardedParams, unit.padded_numel * 4);
  in_flight_.push_back(std::move(f));
  auto handle = shard_comm_->StartAllGather(in_flight_.back().low.data(), full_[u].data(), unit.shard_numel);
  if (!handle.ok()) return handle.error();
  in_flight_.back().handle = handle.value();
  return ledger_.Sample("prefetch all-gather");
}

Status FsdpEngine::Unshard(int u) {
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    if (in_flight_[i].unit == u) return WaitFor(i);  // prefetched: wait for it
  }
  if (!full_[u].empty()) return {};
  const WrapUnit& unit = w_.units[u];
  std::vector<float> low(shard_[u].size());
  for (size_t i = 0; i < low.size(); ++i) low[i] = RoundTo(shard_[u][i], w_.config.param_dtype);
  ledger_.Add(Mem::kCommBuffers, unit.shard_numel * 4);
  full_[u].resize(static_cast<size_t>(unit.padded_numel));
  ledger_.Add(Mem::kUnshardedParams, unit.padded_numel * 4);
  Status s = ledger_.Sample(u == 0 ? "all-gather of the root" : "all-gather of a block");
  if (s.ok()) s = shard_comm_->AllGather(low.data(), full_[u].data(), unit.shard_numel);
  ledger_.Sub(Mem::kCommBuffers, unit.shard_numel * 4);
  return s;
}

void FsdpEngine::Reshard(int u) {
  ledger_.Sub(Mem::kUnshardedParams, static_cast<int64_t>(full_[u].size()) * 4);
  std::vector<float>().swap(full_[u]);
}

// Reduce-scatter the unit's gradient (rounded to reduce_dtype) within the shard group, all-reduce
// the shard across replicas, average over the world, accumulate into the fp32 gradient shard.
Status FsdpEngine::Reduce(int u) {
  std::vector<float>& g = full_grad_[u];
  for (float& v : g) v = RoundTo(v, w_.config.reduce_dtype);
  std::vector<float> shard(static_cast<size_t>(w_.units[u].shard_numel));
  ledger_.Add(Mem::kCommBuffers, w_.units[u].shard_numel * 4);
  if (grad_shard_[u].empty()) {  // allocated before the sample, so that the heap holds what the ledger counts
    grad_shard_[u].assign(shard.size(), 0.0f);
    ledger_.Add(Mem::kGradients, w_.units[u].shard_numel * 4);
  }
  if (Status st = ledger_.Sample(u == 0 ? "reduce-scatter of the root" : "reduce-scatter of a block"); !st.ok()) return st;
  if (Status s = shard_comm_->ReduceScatter(g.data(), shard.data(), w_.units[u].shard_numel); !s.ok()) return s;
  if (replica_comm_->size() > 1) {
    if (Status s = replica_comm_->AllReduce(shard.data(), static_cast<int64_t>(shard.size())); !s.ok()) return s;
  }
  // the mean over the world's micro-batches, unscaled (S a power of two: exact)
  const float scale = 1.0f / (static_cast<float>(world_.size() * w_.config.grad_accum) * scaler_.scale());
  for (size_t i = 0; i < shard.size(); ++i) grad_shard_[u][i] += shard[i] * scale;
  ledger_.Sub(Mem::kCommBuffers, w_.units[u].shard_numel * 4);
  ledger_.Sub(Mem::kGradients, static_cast<int64_t>(g.size()) * 4);
  std::vector<float>().swap(g);
  return {};
}

std::vector<int32_t> TrainingTokens(const Workload& w, const TrainOptions& o, int64_t step, int64_t micro, int rank, int world) {
  const int64_t vocab = w.model.vocab_size;
  // sequence index in the global batch: (micro * world + rank) * micro_batch + i, seq + 1 tokens each
  const int64_t seq = w.config.seq_len, mb = w.config.micro_batch;
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(mb * (seq + 1)));
  for (int64_t i = 0; i < mb; ++i) {
    const int64_t sequence = ((step * w.config.grad_accum + micro) * world + rank) * mb + i;
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

Result<float> FsdpEngine::MicroBatch(int64_t step, int64_t micro) {
  const auto forward_start = std::chrono::steady_clock::now();
  const int64_t seq = w_.config.seq_len, mb = w_.config.micro_batch, h = dims_.hidden, vocab = dims_.vocab;
  const std::vector<int32_t> all = TrainingTokens(w_, o_, step, micro, world_.rank(), world_.size());
  std::vector<int32_t> inputs, targets;
  for (int64_t i = 0; i < mb; ++i) {
    inputs.insert(inputs.end(), all.begin() + i * (seq + 1), all.begin() + i * (seq + 1) + seq);
    targets.insert(targets.end(), all.begin() + i * (seq + 1) + 1, all.begin() + (i + 1) * (seq + 1));
  }
  // root: embed (V*h), [every block with --wrap none], final norm (h), lm_head (V*h, absent when tied)
  const LlamaDims::RootOffsets root_at = dims_.Root(block_unit_);
  if (Status s = Unshard(0); !s.ok()) return s.error();
  const float* root = full_[0].data();
  const float* embed = root;
  const float* norm_w = root + root_at.norm;
  const float* head = root + root_at.head;
  const int64_t block_numel = dims_.BlockNumel();
  auto block_params = [&](int b) -> float* {
    const int u = block_unit_[b];
    return full_[u].data() + (u == 0 ? vocab * h + static_cast<int64_t>(b) * block_numel : 0);
  };
  Mat x = EmbeddingForward(ConstMatMap(embed, vocab, h), inputs);
  std::vector<BlockCache> caches(static_cast<size_t>(dims_.layers));
  std::vector<Mat> inputs_saved(static_cast<size_t>(dims_.layers));
  const bool ac = w_.config.checkpointing == Checkpointing::kFull;
  const bool selective = w_.config.checkpointing == Checkpointing::kSelective;  // the probabilities are recomputed
  for (int b = 0; b < dims_.layers; ++b) {
    const int u = block_unit_[b];
    if (Status s = Unshard(u); !s.ok()) return s.error();
    if (w_.config.forward_prefetch && b + 1 < dims_.layers && block_unit_[b + 1] != u) {
      if (Status s = Prefetch(block_unit_[b + 1]); !s.ok()) return s.error();
    }
    if (ac) {
      inputs_saved[b] = x;
      ledger_.Add(Mem::kActivations, x.size() * 4);
    }
    x = BlockForward(dims_, block_params(b), x, mb, seq, ac ? nullptr : &caches[b]);
    if (selective) DropAttentionCore(caches[b]);
    if (!ac) ledger_.Add(Mem::kActivations, caches[b].SavedBytes());
    if (Status st = ledger_.Sample("forward of a block"); !st.ok()) return st.error();
    if (u != 0 && ReshardAfterForward(u)) Reshard(u);
  }
  Vec inv;
  const Mat normed = RmsNormForward(x, Eigen::Map<const Vec>(norm_w, h), dims_.rms_eps, inv);
  const Mat logits = LinearForward(normed, ConstMatMap(head, vocab, h));
  Mat d_logits;
  const float loss = CrossEntropy(logits, targets, d_logits);
  if (scaler_.enabled()) d_logits *= scaler_.scale();  // GradScaler.scale(loss).backward()
  const int64_t head_bytes = (logits.size() + d_logits.size() + normed.size() + x.size()) * 4;
  ledger_.Add(Mem::kActivations, head_bytes);
  if (Status st = ledger_.Sample("loss"); !st.ok()) return st.error();
  times_.forward_s += Seconds(forward_start);
  const auto backward_start = std::chrono::steady_clock::now();
  // backward
  if (full_grad_[0].empty()) {  // under no_sync it holds the earlier micro-batches' gradients
    full_grad_[0].assign(full_[0].size(), 0.0f);
    ledger_.Add(Mem::kGradients, static_cast<int64_t>(full_[0].size()) * 4);
  }
  float* root_grad = full_grad_[0].data();
  MatMap g_head(root_grad + root_at.head, vocab, h);
  Mat d_normed = LinearBackward(d_logits, normed, ConstMatMap(head, vocab, h), g_head);
  Eigen::Map<Vec> g_norm(root_grad + root_at.norm, h);
  Mat dx = RmsNormBackward(d_normed, x, Eigen::Map<const Vec>(norm_w, h), inv, g_norm);
  for (int b = static_cast<int>(dims_.layers) - 1; b >= 0; --b) {
    const int u = block_unit_[b];
    if (Status s = Unshard(u); !s.ok()) return s.error();
    const int previous = b > 0 ? block_unit_[b - 1] : -1;
    if (w_.config.backward_prefetch == BackwardPrefetch::kPre && previous > 0 && previous != u) {
      if (Status s = Prefetch(previous); !s.ok()) return s.error();  // BACKWARD_PRE: before this block's backward
    }
    if (full_grad_[u].empty()) {
      full_grad_[u].assign(full_[u].size(), 0.0f);
      ledger_.Add(Mem::kGradients, static_cast<int64_t>(full_[u].size()) * 4);
    }
    if (ac) {
      BlockForward(dims_, block_params(b), inputs_saved[b], mb, seq, &caches[b]);
      ledger_.Add(Mem::kActivations, caches[b].SavedBytes());
    }
    if (selective) ledger_.Add(Mem::kActivations, RecomputeAttentionCore(dims_, caches[b], mb, seq));
    float* grads = full_grad_[u].data() + (u == 0 ? vocab * h + static_cast<int64_t>(b) * block_numel : 0);
    dx = BlockBackward(dims_, block_params(b), grads, dx, caches[b], mb, seq);
    if (Status st = ledger_.Sample("backward of a block"); !st.ok()) return st.error();
    ledger_.Sub(Mem::kActivations, caches[b].SavedBytes());
    caches[b] = BlockCache();
    if (ac) {
      ledger_.Sub(Mem::kActivations, inputs_saved[b].size() * 4);
      inputs_saved[b] = Mat();
    }
    // FSDP1's post-backward hook: reshard, then the BACKWARD_POST prefetch (_post_backward_reshard),
    // then the reduce-scatter
    if (u != 0 && w_.FreesInBackward(reduce_now_)) Reshard(u);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPost && previous > 0 && previous != u) {
      if (Status s = Prefetch(previous); !s.ok()) return s.error();
    }
    if (u != 0 && reduce_now_) {
      if (Status s = Reduce(u); !s.ok()) return s.error();
    }
  }
  MatMap g_embed(root_grad, vocab, h);
  EmbeddingBackward(dx, inputs, g_embed);
  ledger_.Sub(Mem::kActivations, head_bytes);
  if (w_.FreesInBackward(reduce_now_)) Reshard(0);
  if (reduce_now_) {
    if (Status s = Reduce(0); !s.ok()) return s.error();
  }
  times_.backward_s += Seconds(backward_start);
  return loss;
}

Result<bool> FsdpEngine::FoundNonFinite() {
  const bool here = std::any_of(grad_shard_.begin(), grad_shard_.end(), [](const std::vector<float>& g) {
    return std::any_of(g.begin(), g.end(), [](float v) { return !std::isfinite(v); });
  });
  float found = here ? 1.0f : 0.0f;
  if (Status s = world_.AllReduce(&found, 1); !s.ok()) return s.error();
  return found > 0.0f;
}

Status FsdpEngine::Optimizer() {
  const auto start = std::chrono::steady_clock::now();
  if (Status st = ledger_.Sample("optimizer step"); !st.ok()) return st;
  auto allowed = scaler_.CheckAndUpdate([this] { return FoundNonFinite(); });
  if (!allowed.ok()) return allowed.error();
  const bool apply = allowed.value();
  const auto [c1, c2] = AdamBiasCorrections(o_, optimizer_steps_);
  for (size_t u = 0; u < shard_.size(); ++u) {
    for (size_t i = 0; apply && i < shard_[u].size(); ++i) {
      const float g = grad_shard_[u].empty() ? 0.0f : grad_shard_[u][i];
      float& p = shard_[u][i];
      exp_avg_[u][i] = o_.beta1 * exp_avg_[u][i] + (1 - o_.beta1) * g;
      exp_avg_sq_[u][i] = o_.beta2 * exp_avg_sq_[u][i] + (1 - o_.beta2) * g * g;
      p -= o_.lr * o_.weight_decay * p;
      p -= o_.lr * (exp_avg_[u][i] / c1) / (std::sqrt(exp_avg_sq_[u][i] / c2) + o_.eps);
    }
    ledger_.Sub(Mem::kGradients, static_cast<int64_t>(grad_shard_[u].size()) * 4);
    std::vector<float>().swap(grad_shard_[u]);  // zero_grad(set_to_none=True)
  }
  if (apply) ++optimizer_steps_;
  times_.optimizer_s += Seconds(start);
  return {};
}

Result<float> FsdpEngine::Step(int64_t step) {
  double loss_sum = 0;
  for (int64_t m = 0; m < w_.config.grad_accum; ++m) {
    reduce_now_ = !w_.config.no_sync || m == w_.config.grad_accum - 1;
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
