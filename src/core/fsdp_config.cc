#include "core/fsdp_config.h"

#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "core/families/family.h"
#include "core/hardware_spec.h"
#include "core/model_spec.h"

namespace fsdp {
namespace {

// Limits beyond which a number is a typo rather than a plan.
constexpr int64_t kMaxGpus = 1'000'000;
constexpr int64_t kMaxSeqLen = 10'000'000;
constexpr int64_t kMaxMicroBatch = 1'000'000;
constexpr int64_t kMaxGradAccum = 1'000'000;

Error Unknown(std::string_view what, std::string_view value, std::string_view choices) {
  return Error::BadInput(fmt::format("unknown {} '{}' (expected {})", what, value, choices));
}

Status CheckRange(std::string_view what, int64_t value, int64_t max_value) {
  if (value < 1 || value > max_value) {
    return Error::BadInput(fmt::format("{} must be between 1 and {}, got {}", what, max_value, value));
  }
  return {};
}

}  // namespace

std::string_view StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kFullShard: return "FULL_SHARD";
    case Strategy::kShardGradOp: return "SHARD_GRAD_OP";
    case Strategy::kNoShard: return "NO_SHARD";
    case Strategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}
std::string_view WrapPolicyName(WrapPolicy w) {
  switch (w) {
    case WrapPolicy::kBlock: return "block";
    case WrapPolicy::kSize: return "size";
    case WrapPolicy::kNone: return "none";
    case WrapPolicy::kLinear: return "linear";
    case WrapPolicy::kPeft: return "peft";
  }
  return "?";
}
std::string_view CheckpointingName(Checkpointing c) {
  switch (c) {
    case Checkpointing::kNone: return "none";
    case Checkpointing::kSelective: return "selective";
    case Checkpointing::kSelectiveOp: return "selective-op";
    case Checkpointing::kFull: return "full";
  }
  return "?";
}
std::string_view AttentionName(Attention a) { return a == Attention::kEager ? "eager" : "flash"; }
std::string_view OptimizerName(Optimizer o) {
  switch (o) {
    case Optimizer::kAdamW: return "adamw";
    case Optimizer::kAdam: return "adam";
    case Optimizer::kSgd: return "sgd";
    case Optimizer::kSgdMomentum: return "sgd-momentum";
  }
  return "?";
}
std::string_view FrameworkName(Framework f) { return f == Framework::kFsdp1 ? "fsdp1" : "fsdp2"; }
std::string_view BackwardPrefetchName(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kPre: return "pre";
    case BackwardPrefetch::kPost: return "post";
    case BackwardPrefetch::kNone: return "none";
  }
  return "?";
}

std::string_view ImplName(Impl i) {
  switch (i) {
    case Impl::kTransformers: return "transformers";
    case Impl::kTorchtitan: return "torchtitan";
    case Impl::kTorchtitan202501: return "torchtitan-2025-01";
  }
  return "?";
}

Result<Impl> ParseImpl(std::string_view t) {
  if (t == "transformers") return Impl::kTransformers;
  if (t == "torchtitan" || t == "torchtitan-0.2.2") return Impl::kTorchtitan;
  if (t == "torchtitan-2025-01") return Impl::kTorchtitan202501;
  return Unknown("--impl", t, "transformers, torchtitan (0.2.2) or torchtitan-2025-01");
}

std::string_view TorchDeviceName(TorchDevice d) { return d == TorchDevice::kCpu ? "cpu" : "cuda"; }

Result<TorchDevice> ParseTorchDevice(std::string_view t) {
  if (t == "cuda") return TorchDevice::kCuda;
  if (t == "cpu") return TorchDevice::kCpu;
  return Unknown("--torch-device", t, "cuda or cpu");
}

HfLoss HfLossOf(TransformersVersion v, std::string_view model_type) {
  if (v >= TransformersVersion{4, 49}) return HfLoss::kPaddedLabels;
  const families::Family* f = families::FindFamily(model_type);
  const TransformersVersion loss_function_since = f != nullptr ? f->loss_function_since : TransformersVersion{4, 46};
  return v >= loss_function_since ? HfLoss::kShiftedCopy : HfLoss::kFp32Logits;
}

bool HasPerLayerRopeTables(TransformersVersion v, std::string_view model_type) {
  const families::Family* f = families::FindFamily(model_type);
  return f != nullptr && v <= f->rope_tables_until;
}

bool HasCausalMaskBuffer(TransformersVersion v, std::string_view model_type) {
  const families::Family* f = families::FindFamily(model_type);
  return f != nullptr && v == f->causal_mask_buffer_in;
}

std::string TransformersVersionName(TransformersVersion v) { return fmt::format("{}.{}", v.major, v.minor); }

// The leading run of digits of `t` from `pos` on, or -1 when there is none (or it is absurd).
static int ReadVersionPart(std::string_view t, size_t& pos) {
  int value = 0;
  const size_t start = pos;
  while (pos < t.size() && t[pos] >= '0' && t[pos] <= '9' && pos - start < 4) value = value * 10 + (t[pos++] - '0');
  return pos == start || (pos < t.size() && t[pos] >= '0' && t[pos] <= '9') ? -1 : value;
}

Result<TransformersVersion> ParseTransformersVersion(std::string_view t) {
  const auto bad = [&] { return Error::BadInput(fmt::format("--transformers-version '{}' is not a release number like 4.44 or 4.44.2", t)); };
  size_t pos = 0;
  TransformersVersion v;
  if ((v.major = ReadVersionPart(t, pos)) < 0 || pos >= t.size() || t[pos++] != '.' || (v.minor = ReadVersionPart(t, pos)) < 0) return bad();
  if (pos + 1 < t.size() && t[pos] == '.' && std::isdigit(static_cast<unsigned char>(t[pos + 1]))) {  // the patch
    ++pos;
    if (ReadVersionPart(t, pos) < 0) return bad();
  }
  const std::string_view rest = t.substr(pos);  // a pre-, dev- or post-release: a, b, rc, .dev, .post and a number
  for (std::string_view tag : {"a", "b", "rc", ".dev", ".post"}) {
    if (rest.starts_with(tag) && rest.size() > tag.size()) {
      size_t number = pos + tag.size();
      if (ReadVersionPart(t, number) < 0 || number != t.size()) return bad();
      pos = number;
      break;
    }
  }
  if (pos != t.size()) return bad();
  if (v < TransformersVersion{4, 31}) {
    return Error::BadInput(fmt::format("--transformers-version {}: releases before 4.31 computed the loss in the logits' own dtype, which is not modelled", t));
  }
  if ((v.major == 4 && v.minor > 57) || v.major > 5) {
    return Error::BadInput(fmt::format("--transformers-version {} is not a release fsdp-plan knows: 4.31 to 4.57, or 5.x", t));
  }
  return v;
}

Result<Strategy> ParseStrategy(std::string_view t) {
  if (t == "full_shard" || t == "FULL_SHARD") return Strategy::kFullShard;
  if (t == "shard_grad_op" || t == "SHARD_GRAD_OP") return Strategy::kShardGradOp;
  if (t == "no_shard" || t == "NO_SHARD" || t == "ddp") return Strategy::kNoShard;
  if (t == "hybrid_shard" || t == "HYBRID_SHARD" || t == "hsdp") return Strategy::kHybridShard;
  return Unknown("strategy", t, "full_shard, shard_grad_op, no_shard or hybrid_shard");
}

Status ParseWrap(std::string_view t, FsdpConfig& config) {
  if (t == "block") { config.wrap = WrapPolicy::kBlock; return {}; }
  if (t == "none") { config.wrap = WrapPolicy::kNone; return {}; }
  if (t == "linear") { config.wrap = WrapPolicy::kLinear; return {}; }
  if (t == "peft") { config.wrap = WrapPolicy::kPeft; return {}; }
  if (t.starts_with("size:")) {
    std::string number(t.substr(5));
    char* end = nullptr;
    double n = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(n) || n < 1 || n > 1e13 || n != std::floor(n)) {
      return Error::BadInput(fmt::format("--wrap size:N needs a whole number of parameters between 1 and 1e13, got '{}'", number));
    }
    config.wrap = WrapPolicy::kSize;
    config.wrap_min_params = static_cast<int64_t>(n);
    return {};
  }
  return Unknown("wrap policy", t, "block, size:N, none, linear or peft");
}

Result<Checkpointing> ParseCheckpointing(std::string_view t) {
  if (t == "none") return Checkpointing::kNone;
  if (t == "selective") return Checkpointing::kSelective;
  if (t == "selective-op") return Checkpointing::kSelectiveOp;
  if (t == "full") return Checkpointing::kFull;
  return Unknown("activation checkpointing mode", t, "none, selective, selective-op or full");
}
Result<Attention> ParseAttention(std::string_view t) {
  if (t == "eager") return Attention::kEager;
  if (t == "flash" || t == "sdpa") return Attention::kFlash;
  return Unknown("attention implementation", t, "eager or flash");
}
Result<Optimizer> ParseOptimizer(std::string_view t) {
  if (t == "adamw") return Optimizer::kAdamW;
  if (t == "adam") return Optimizer::kAdam;
  if (t == "sgd") return Optimizer::kSgd;
  if (t == "sgd-momentum" || t == "sgd_momentum") return Optimizer::kSgdMomentum;
  return Unknown("optimizer", t, "adamw, adam, sgd or sgd-momentum");
}
Result<Framework> ParseFramework(std::string_view t) {
  if (t == "fsdp1") return Framework::kFsdp1;
  if (t == "fsdp2") return Framework::kFsdp2;
  return Unknown("framework", t, "fsdp1 or fsdp2");
}
Result<BackwardPrefetch> ParseBackwardPrefetch(std::string_view t) {
  if (t == "pre" || t == "BACKWARD_PRE") return BackwardPrefetch::kPre;
  if (t == "post" || t == "BACKWARD_POST") return BackwardPrefetch::kPost;
  if (t == "none") return BackwardPrefetch::kNone;
  return Unknown("backward prefetch", t, "pre, post or none");
}

// The master dtype: fp32 (mixed precision's master copy) or bf16 (pure bf16: parameters, gradients
// and optimizer states in bf16). fp16 masters have no fp32 copy for GradScaler to unscale into
// (torch/amp/grad_scaler.py refuses "Attempting to unscale FP16 gradients").
static Status ValidatePrecision(const FsdpConfig& c) {
  if (c.master_dtype == DType::kFp16) {
    return Error::BadInput("--master-dtype fp16: GradScaler cannot unscale fp16 gradients; train fp16 with --master-dtype fp32");
  }
  if (BytesPerElement(c.param_dtype) > BytesPerElement(c.master_dtype)) {
    return Error::BadInput(fmt::format("--param-dtype {} is wider than --master-dtype {}: FSDP casts the stored parameters down for compute, not up",
                                       DTypeName(c.param_dtype), DTypeName(c.master_dtype)));
  }
  if (c.master_dtype == DType::kBf16 && c.param_dtype != DType::kBf16) {
    return Error::BadInput(fmt::format("--master-dtype bf16 computes in bf16; --param-dtype {} does not match", DTypeName(c.param_dtype)));
  }
  return {};
}

static Status ValidateLora(const LoraConfig& l, WrapPolicy wrap) {
  if (l.rank < 0 || l.rank > (int64_t{1} << 20)) return Error::BadInput(fmt::format("--lora-rank {} is out of range (0 for full fine-tuning, or 1..1048576)", l.rank));
  if (!(l.dropout >= 0 && l.dropout < 1)) return Error::BadInput(fmt::format("--lora-dropout {} is not a probability in [0, 1)", l.dropout));
  if (!(l.alpha > 0 && l.alpha < 1e9)) return Error::BadInput(fmt::format("--lora-alpha {} is not a positive number", l.alpha));
  if (l.rank == 0 && !l.targets.empty()) return Error::BadInput("--lora-targets needs --lora-rank R > 0");
  if (l.rank == 0 && l.dropout != 0) return Error::BadInput("--lora-dropout needs --lora-rank R > 0");
  if (l.rank == 0 && l.qlora) return Error::BadInput("--qlora trains LoRA adapters on a 4-bit base; it needs --lora-rank R > 0");
  if (!l.qlora && l.double_quant) return Error::BadInput("--qlora-double-quant needs --qlora");
  if (!l.qlora && l.compute_dtype) return Error::BadInput("--qlora-compute-dtype needs --qlora");
  if (l.rank == 0 && wrap == WrapPolicy::kPeft) return Error::BadInput("--wrap peft wraps LoRA adapters; it needs --lora-rank R > 0");
  return {};
}

// torchtitan trains with FSDP2 (apply_fsdp), SDPA, its own wrap units and no LoRA; its
// activation checkpointing offers full, layer-level (every N-th block: --ac-every) and op-level.
static Status ValidateTorchtitan(const FsdpConfig& c, const ModelSpec& model) {
  if (const std::string why = TorchtitanRuledOut(model, c.impl); !why.empty()) return Error::BadInput(why);
  if (c.framework != Framework::kFsdp2) return Error::BadInput(fmt::format("--impl {} shards with FSDP2 (fully_shard); add --framework fsdp2", ImplName(c.impl)));
  if (c.wrap != WrapPolicy::kBlock) {
    return Error::BadInput(fmt::format("--impl {} wraps as its apply_fsdp does; --wrap {} does not apply", ImplName(c.impl), WrapPolicyName(c.wrap)));
  }
  if (c.attention != Attention::kFlash) return Error::BadInput(fmt::format("--impl {} runs SDPA; --attention eager does not apply", ImplName(c.impl)));
  if (c.checkpointing == Checkpointing::kSelective) {
    return Error::BadInput(fmt::format("--impl {} has no attention-core checkpointing; its modes are --ac none, full (--ac-every N: layer-level) and selective-op", ImplName(c.impl)));
  }
  if (c.lora.rank > 0) return Error::BadInput(fmt::format("--impl {} trains every parameter; LoRA is transformers' (peft's)", ImplName(c.impl)));
  if (c.no_sync) return Error::BadInput(fmt::format("--impl {} reduce-scatters every micro-batch (its training loop has no no_sync); --no-sync does not apply", ImplName(c.impl)));
  // torchtitan 0.2.2's config/job_config.py: mixed_precision_param bfloat16 | float32,
  // mixed_precision_reduce float32; components/optimizer.py: Adam or AdamW; train.py: `del pred`
  if (c.param_dtype == DType::kFp16) return Error::BadInput(fmt::format("--impl {}: torchtitan's mixed_precision_param is bfloat16 or float32, not fp16", ImplName(c.impl)));
  if (c.reduce_dtype != DType::kFp32) return Error::BadInput(fmt::format("--impl {}: torchtitan's mixed_precision_reduce is float32 only", ImplName(c.impl)));
  if (c.optimizer != Optimizer::kAdamW && c.optimizer != Optimizer::kAdam) {
    return Error::BadInput(fmt::format("--impl {}: torchtitan's optimizers are Adam and AdamW, not {}", ImplName(c.impl), OptimizerName(c.optimizer)));
  }
  if (c.loop_holds_outputs) return Error::BadInput(fmt::format("--impl {}: torchtitan's training loop deletes the logits before backward; --loop-holds-outputs does not apply", ImplName(c.impl)));
  if (c.transformers != TransformersVersion{}) {
    return Error::BadInput(fmt::format("--impl {} runs torchtitan's model and loss; --transformers-version does not apply", ImplName(c.impl)));
  }
  if (c.use_cache) return Error::BadInput(fmt::format("--impl {}: torchtitan's model keeps no key/value cache; --use-cache does not apply", ImplName(c.impl)));
  return {};
}

// --use-cache: the tuple cache of transformers 4.31 to 4.35 (LlamaModel.forward's
// next_decoder_cache; 4.36 replaced it with a DynamicCache the layers write into)
static Status ValidateUseCache(const FsdpConfig& c) {
  if (!c.use_cache) return {};
  if (c.transformers < TransformersVersion{4, 31} || TransformersVersion{4, 35} < c.transformers) {
    return Error::BadInput(fmt::format("--use-cache is modelled for transformers 4.31 to 4.35 (each layer returns its key and value states as a tuple), "
                                       "not {}: from 4.36 the layers write a DynamicCache; add --transformers-version 4.31 to 4.35",
                                       TransformersVersionName(c.transformers)));
  }
  if (c.loop_holds_outputs && (c.checkpointing != Checkpointing::kFull || c.ac_every != 1)) {
    return Error::BadInput(fmt::format("--use-cache with --loop-holds-outputs is modelled with every block checkpointed (--ac full), not --ac {}{}: "
                                       "an un-checkpointed block's saved keys and values would outlive their backward",
                                       CheckpointingName(c.checkpointing), c.ac_every != 1 ? fmt::format(" --ac-every {}", c.ac_every) : ""));
  }
  return {};
}

bool ReentrantHoldsInputs(const FsdpConfig& c) {
  return c.ac_reentrant && c.framework == Framework::kFsdp1 && c.transformers < TransformersVersion{4, 52};
}

// --ac-reentrant: transformers' gradient checkpointing with use_reentrant=True
static Status ValidateReentrant(const FsdpConfig& c) {
  if (!c.ac_reentrant) return {};
  if (c.checkpointing != Checkpointing::kFull) {
    return Error::BadInput(fmt::format("--ac-reentrant describes transformers' gradient checkpointing of whole decoder layers: it needs --ac full, not --ac {}",
                                       CheckpointingName(c.checkpointing)));
  }
  if (IsTorchtitan(c.impl)) return Error::BadInput(fmt::format("--impl {} checkpoints with torchtitan's own (non-reentrant) wrapper; --ac-reentrant does not apply", ImplName(c.impl)));
  if (c.ac_every != 1) {
    return Error::BadInput(fmt::format("--ac-reentrant: transformers' gradient checkpointing checkpoints every decoder layer, not every {}", c.ac_every));
  }
  if (c.use_cache) return Error::BadInput("--ac-reentrant with --use-cache: transformers' gradient checkpointing sets use_cache=False in training");
  return {};
}

Status ResolveAndValidate(FsdpConfig& c, const ModelSpec& model, const HardwareSpec& hw) {
  if (Status s = CheckRange("--gpus", c.gpus, kMaxGpus); !s.ok()) return s;
  if (c.gpus_per_node == 0) c.gpus_per_node = std::min(hw.gpus_per_node, c.gpus);
  if (Status s = CheckRange("--gpus-per-node", c.gpus_per_node, kMaxGpus); !s.ok()) return s;
  if (c.gpus > c.gpus_per_node && c.gpus % c.gpus_per_node != 0) {
    return Error::BadInput(fmt::format("--gpus {} is not a whole number of nodes of {} GPUs (--gpus-per-node)", c.gpus, c.gpus_per_node));
  }
  if (c.seq_len == 0) c.seq_len = std::min<int64_t>(4096, model.max_position_embeddings);
  if (Status s = CheckRange("--seq-len", c.seq_len, kMaxSeqLen); !s.ok()) return s;
  if (!model.arch.names.positions.empty() && c.seq_len > model.max_position_embeddings) {
    return Error::BadInput(fmt::format("--seq-len {} exceeds {}'s {} learned positions (n_positions)", c.seq_len, model.id, model.max_position_embeddings));
  }
  if (Status s = CheckRange("--micro-batch", c.micro_batch, kMaxMicroBatch); !s.ok()) return s;
  if (Status s = CheckRange("--grad-accum", c.grad_accum, kMaxGradAccum); !s.ok()) return s;
  if (Status s = CheckRange("--ac-every", c.ac_every, int64_t{1'000'000}); !s.ok()) return s;
  if (c.ac_every > 1 && c.checkpointing != Checkpointing::kFull) {
    return Error::BadInput(fmt::format("--ac-every {} needs --ac full (it checkpoints every N-th block whole), not --ac {}", c.ac_every,
                                       CheckpointingName(c.checkpointing)));
  }
  if (c.attention == Attention::kFlash) {
    if (const std::string why = SdpaRuledOut(model); !why.empty()) return Error::BadInput(fmt::format("--attention flash: {}; use --attention eager", why));
  }
  if (c.checkpointing == Checkpointing::kSelectiveOp && !OpCheckpointingModelled(model)) {
    return Error::BadInput(fmt::format("--ac selective-op (torchtitan's op-level policy) is modelled for dense, bias-free Llama-style blocks, "
                                       "not {}'s",
                                       model.id));
  }
  if (c.no_sync && c.grad_accum == 1) return Error::BadInput("--no-sync needs --grad-accum > 1 (it only changes how micro-batches accumulate)");
  if (c.strategy == Strategy::kHybridShard) {
    if (c.shard_group_size == 0) c.shard_group_size = std::min(c.gpus_per_node, c.gpus);
    if (c.shard_group_size < 1 || c.gpus % c.shard_group_size != 0) {
      return Error::BadInput(fmt::format("HYBRID_SHARD shard group of {} GPUs does not divide --gpus {}", c.shard_group_size, c.gpus));
    }
  } else if (c.shard_group_size != 0) {
    return Error::BadInput(fmt::format("--shard-group-size only applies to --strategy hybrid_shard, not {}", StrategyName(c.strategy)));
  }
  if (c.framework == Framework::kFsdp2) {
    if (c.strategy == Strategy::kNoShard) return Error::BadInput("--framework fsdp2 has no NO_SHARD (use DDP / replicate, or --framework fsdp1)");
    if (c.backward_prefetch == BackwardPrefetch::kPost) return Error::BadInput("--framework fsdp2 has no BACKWARD_POST prefetch (it always prefetches one group ahead)");
  }
  if (c.reduce_dtype == DType::kFp16 && c.param_dtype == DType::kBf16) {
    return Error::BadInput("--reduce-dtype fp16 with --param-dtype bf16 loses range; use fp32 or bf16");
  }
  if (Status s = ValidatePrecision(c); !s.ok()) return s;
  if (c.lora.base_dtype) {
    if (c.lora.rank == 0) return Error::BadInput("--base-dtype is the frozen base's dtype under LoRA; it needs --lora-rank R > 0");
    if (*c.lora.base_dtype == DType::kFp16) return Error::BadInput("--base-dtype fp16 is not modelled: fp32 or bf16");
    if (c.lora.qlora && *c.lora.base_dtype != c.param_dtype) {
      return Error::BadInput(fmt::format("--qlora packs its base in the param dtype ({}), so that FSDP's cast leaves the 4-bit codes alone; "
                                         "--base-dtype {} differs", DTypeName(c.param_dtype), DTypeName(*c.lora.base_dtype)));
    }
  }
  if (IsTorchtitan(c.impl)) {
    if (Status s = ValidateTorchtitan(c, model); !s.ok()) return s;
  }
  if (const std::string why = TransformersRuledOut(model, c.transformers); !why.empty()) return Error::BadInput(why);
  if (c.attention == Attention::kFlash && c.transformers < TransformersVersion{4, 34}) {  // LlamaAttention alone until then
    return Error::BadInput(fmt::format("--transformers-version {} runs attention eagerly (FlashAttention-2 from 4.34, SDPA from 4.36); add --attention eager",
                                       TransformersVersionName(c.transformers)));
  }
  if (Status s = ValidateUseCache(c); !s.ok()) return s;
  if (Status s = ValidateReentrant(c); !s.ok()) return s;
  return ValidateLora(c.lora, c.wrap);
}

std::string TorchtitanRuledOut(const ModelSpec& m, Impl impl) {
  const bool qwen3 = impl == Impl::kTorchtitan && m.model_type == "qwen3";
  if ((m.model_type != "llama" && !qwen3) || !OpCheckpointingModelled(m) || m.qk_l2_norm) {
    return fmt::format("{} is a {} model; --impl {} models torchtitan's {}", m.id, m.model_type, ImplName(impl),
                       impl == Impl::kTorchtitan ? "Llama 3 and dense Qwen3 (bias-free pre-norm blocks)" : "Llama 3 (dense, bias-free pre-norm Llama blocks)");
  }
  if (qwen3 && m.sliding_window > 0) return fmt::format("{} attends through a sliding window, which torchtitan's Qwen3 does not", m.id);
  if (m.tie_word_embeddings) return fmt::format("{} ties lm_head to the embedding, which fsdp-plan's torchtitan profiles do not model", m.id);
  return "";
}

std::string TransformersRuledOut(const ModelSpec& m, TransformersVersion v) {
  const families::Family* f = families::FindFamily(m.model_type);
  if (f == nullptr || v >= f->plannable_since) return "";
  if (m.model_type == "gpt2") {
    return fmt::format("--transformers-version {}: GPT-2's loss before 4.48 ran in the logits' own dtype, which is not modelled", TransformersVersionName(v));
  }
  return fmt::format("--transformers-version {}: transformers has {} models from {} on", TransformersVersionName(v), m.model_type,
                     TransformersVersionName(f->plannable_since));
}

// torchtitan's policy counts aten.mm calls; a Linear with a bias runs as addmm and shifts which are
// kept. Modelled on Llama's pre-norm block with its seven separate projections only (Phi-3's fused
// qkv_proj and gate_up_proj make five calls).
bool OpCheckpointingModelled(const ModelSpec& m) {
  bool separate_projections = false;
  for (const ParamOp& op : m.arch.block) separate_projections |= op.module == "self_attn.q_proj";
  return separate_projections && !m.mla.enabled() && m.arch.dense_layers.empty() && m.arch.norm == NormKind::kRms && m.arch.norm_placement == NormPlacement::kPre && m.arch.mlp == MlpKind::kGated && !m.arch.fused_qkv && !m.qkv_bias && !m.o_bias && !m.mlp_bias;
}

std::string SdpaRuledOut(const ModelSpec& m) {
  if (m.attention_sinks) {
    return fmt::format("{} adds a learned sink logit per head to every softmax, which transformers' SDPA attention does not do "
                       "({} models do not support sdpa; the flash kernels with sinks come from the kernels hub, not modelled)", m.id, m.model_type);
  }
  if (m.attn_logit_softcapping <= 0) return "";
  return fmt::format("{} soft-caps its attention scores (attn_logit_softcapping {}), which transformers' SDPA attention does not do "
                     "({} models do not support sdpa)", m.id, m.attn_logit_softcapping, m.model_type);
}

bool BlockCheckpointed(const FsdpConfig& c, int block) {
  if (c.checkpointing == Checkpointing::kNone) return false;
  if (c.checkpointing != Checkpointing::kFull || c.ac_every <= 1) return true;
  return (block + 1) % c.ac_every == 0;
}

bool Fsdp1SwitchesToNoShard(const FsdpConfig& c) {
  return c.framework == Framework::kFsdp1 && c.gpus == 1 && c.strategy != Strategy::kNoShard;
}

bool ApplyFsdp1WorldOfOne(FsdpConfig& c) {
  if (!Fsdp1SwitchesToNoShard(c)) return false;
  if (c.strategy == Strategy::kHybridShard) c.shard_group_size = 0;  // the shard group goes with the strategy
  c.strategy = Strategy::kNoShard;
  return true;
}

int64_t ShardWorldSize(const FsdpConfig& c) {
  switch (c.strategy) {
    case Strategy::kFullShard:
    case Strategy::kShardGradOp: return c.gpus;
    case Strategy::kHybridShard: return c.shard_group_size;
    case Strategy::kNoShard: return 1;
  }
  return 1;
}

int64_t ReplicaCount(const FsdpConfig& c) { return c.gpus / ShardWorldSize(c); }

}  // namespace fsdp
