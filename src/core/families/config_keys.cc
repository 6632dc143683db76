// Config readers and block pieces the family files share (family.h).
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {

Result<int64_t> ReadDim(const JsonReader& reader, std::initializer_list<const char*> keys, int64_t fallback, int64_t max_value) {
  for (const char* key : keys) {
    auto v = reader.OptionalInt(key);
    if (!v.ok()) return v.error();
    if (!v.value()) continue;
    int64_t x = *v.value();
    if (x <= 0 || x > max_value) return reader.KeyError(key, fmt::format("must be between 1 and {}, got {}", max_value, x));
    return x;
  }
  return fallback;
}

Result<double> ReadProbability(const JsonReader& reader, const char* key, double fallback) {
  auto v = reader.OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return fallback;
  double p = *v.value();
  if (p < 0 || p >= 1) return reader.KeyError(key, fmt::format("dropout probability must be in [0, 1), got {}", p));
  return p;
}

Result<double> ReadPositive(const JsonReader& reader, const char* key, double fallback, double max_value) {
  auto v = reader.OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return fallback;
  const double x = *v.value();
  if (!(x > 0 && x <= max_value)) return reader.KeyError(key, fmt::format("must be positive and at most {}, got {}", max_value, x));
  return x;
}

Result<JsonReader> ReadSubConfig(const JsonReader& r, const char* key) {
  static const Json kEmpty = Json::object();
  const auto it = r.json().find(key);
  if (it == r.json().end() || it->is_null()) return JsonReader(kEmpty, fmt::format("{}: {}", r.origin(), key));
  return r.Object(key);
}

Result<bool> ReadFlag(const JsonReader& reader, const char* key, bool fallback) {
  auto v = reader.OptionalBool(key);
  if (!v.ok()) return v.error();
  return v.value().value_or(fallback);
}

namespace {

// The RoPE scaling object: transformers 4 writes `rope_scaling`, transformers 5 `rope_parameters`
// (which may carry rope_theta); a non-empty rope_scaling wins, as in transformers 5's
// convert_rope_params_to_dict (`rope_scaling or self.rope_parameters`); absent, null or empty
// means no scaling.
Result<std::optional<JsonReader>> RopeObject(const JsonReader& r) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = r.json().find(key);
    if (it == r.json().end() || it->is_null()) continue;
    if (!it->is_object()) return r.KeyError(key, "expected an object");
    if (it->empty()) continue;
    return std::optional<JsonReader>(JsonReader(*it, fmt::format("{}: key '{}'", r.origin(), key)));
  }
  return std::optional<JsonReader>{};
}

// Reads rope_theta and the scaling parameters transformers' _compute_<type>_parameters use, with
// the checks of its _validate_<type>_rope_parameters. Types fsdp-run does not implement (yarn,
// longrope) are kept by name: they change no shape.
Status ReadRopeScaling(const JsonReader& s, int64_t max_positions, RopeScaling& out) {
  auto type = s.OptionalString("rope_type");
  if (!type.ok()) return type.error();
  auto old_type = s.OptionalString("type");
  if (!old_type.ok()) return old_type.error();
  out.type = type.value().value_or(old_type.value().value_or("default"));
  if (out.type != "linear" && out.type != "dynamic" && out.type != "llama3") return {};
  auto factor = s.PositiveNumber("factor");
  if (!factor.ok()) return factor.error();
  if (factor.value() < 1 || factor.value() > 1e6) return s.KeyError("factor", fmt::format("must be between 1 and 1000000, got {}", factor.value()));
  out.factor = factor.value();
  if (out.type != "llama3") return {};
  auto low = s.PositiveNumber("low_freq_factor"), high = s.PositiveNumber("high_freq_factor");
  if (!low.ok()) return low.error();
  if (!high.ok()) return high.error();
  // equal factors (Llama 4 Scout's 1 and 1) leave no band between: transformers only warns
  if (high.value() < low.value()) {
    return s.KeyError("high_freq_factor", fmt::format("must be at least low_freq_factor {}, got {}", low.value(), high.value()));
  }
  out.low_freq_factor = low.value();
  out.high_freq_factor = high.value();
  auto original = ReadDim(s, {"original_max_position_embeddings"}, max_positions, kMaxPositions);
  if (!original.ok()) return original.error();
  out.original_max_positions = original.value();
  return {};
}

// rope_theta (inside the RoPE object, else top level, else the family's default: transformers 5's
// setdefault order) and the scaling.
Status ReadRope(const JsonReader& r, double default_theta, ModelSpec& m) {
  auto object = RopeObject(r);
  if (!object.ok()) return object.error();
  auto theta = ReadPositive(r, "rope_theta", default_theta, 1e12);
  if (!theta.ok()) return theta.error();
  m.rope_theta = theta.value();
  if (!object.value()) return {};
  auto inner = ReadPositive(*object.value(), "rope_theta", m.rope_theta, 1e12);
  if (!inner.ok()) return inner.error();
  m.rope_theta = inner.value();
  return ReadRopeScaling(*object.value(), m.max_position_embeddings, m.rope_scaling);
}

}  // namespace

Status CheckHeads(const JsonReader& r, const ModelSpec& m) {
  if (m.num_heads % m.num_kv_heads != 0) {
    return Error::BadInput(fmt::format("{}: {} attention heads are not divisible by {} key/value heads", r.origin(), m.num_heads, m.num_kv_heads));
  }
  return {};
}

Status ReadDecoderKeys(const JsonReader& r, const DecoderDefaults& d, ModelSpec& m) {
  FSDP_ASSIGN(m.vocab_size, ReadDim(r, {"vocab_size"}, d.vocab_size, kMaxVocab));
  FSDP_ASSIGN(m.hidden_size, ReadDim(r, {"hidden_size"}, d.hidden_size, kMaxDim));
  FSDP_ASSIGN(m.num_layers, ReadDim(r, {"num_hidden_layers"}, d.num_layers, kMaxLayers));
  FSDP_ASSIGN(m.num_heads, ReadDim(r, {"num_attention_heads"}, d.num_heads, kMaxDim));
  FSDP_ASSIGN(m.max_position_embeddings, ReadDim(r, {"max_position_embeddings"}, d.max_position_embeddings, kMaxPositions));
  FSDP_ASSIGN(m.intermediate_size, ReadDim(r, {"intermediate_size"}, d.intermediate_size, kMaxDim));
  FSDP_ASSIGN(m.num_kv_heads, ReadDim(r, {"num_key_value_heads"}, d.num_kv_heads == 0 ? m.num_heads : d.num_kv_heads, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const int64_t head_dim, ReadDim(r, {"head_dim"}, 0, kMaxDim));
  // an explicit null is hidden / heads in every configuration class (their __post_init__)
  const auto head_dim_key = r.json().find("head_dim");
  const bool head_dim_null = head_dim_key != r.json().end() && head_dim_key->is_null();
  if (head_dim == 0 && d.head_dim > 0 && !head_dim_null) {
    m.head_dim = d.head_dim;
  } else if (head_dim == 0 && !d.own_head_dim) {
    if (m.hidden_size % m.num_heads != 0) {
      return Error::BadInput(fmt::format("{}: hidden size {} is not divisible by {} attention heads (and no head_dim is given)", r.origin(), m.hidden_size, m.num_heads));
    }
    m.head_dim = m.hidden_size / m.num_heads;
  } else {
    m.head_dim = head_dim;
  }
  FSDP_TRY(CheckHeads(r, m));
  FSDP_ASSIGN(m.norm_eps, ReadPositive(r, "rms_norm_eps", d.rms_norm_eps, 0.1));
  FSDP_TRY(ReadRope(r, d.rope_theta, m));
  FSDP_ASSIGN(m.tie_word_embeddings, ReadFlag(r, "tie_word_embeddings", d.tie_word_embeddings));
  return {};
}

Status ReadActivation(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN_OR_RETURN(const std::optional<std::string> act, r.OptionalString("hidden_act"));
  m.activation = act.value_or("silu");
  FSDP_ASSIGN(m.attention_dropout, ReadProbability(r, "attention_dropout", 0.0));
  return {};
}

Result<int64_t> ReadSlidingWindow(const JsonReader& r, int64_t fallback) {
  const auto it = r.json().find("sliding_window");
  if (it != r.json().end() && it->is_null()) return int64_t{0};
  return ReadDim(r, {"sliding_window"}, fallback, kMaxPositions);
}

Result<int64_t> ReadSlidingWindow(const JsonReader& r) { return ReadSlidingWindow(r, 4096); }

void AddLlamaAttention(const ModelSpec& m, bool qkv_bias, bool o_bias, std::vector<ParamOp>& block) {
  const int64_t h = m.hidden_size, q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
  block.push_back({ParamOp::Kind::kNorm, "input_layernorm", 0, h});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.q_proj", h, q, qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.k_proj", h, kv, qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.v_proj", h, kv, qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.o_proj", q, h, o_bias});
  block.push_back({ParamOp::Kind::kNorm, "post_attention_layernorm", 0, h});
}

Status ReadLayerTypes(const JsonReader& r, int64_t pattern, ModelSpec& m) {
  m.layer_sliding.assign(static_cast<size_t>(m.num_layers), false);
  const auto it = r.json().find("layer_types");
  if (it == r.json().end() || it->is_null()) {
    for (int64_t i = 0; i < m.num_layers; ++i) m.layer_sliding[static_cast<size_t>(i)] = (i + 1) % pattern != 0;
    return {};
  }
  if (!it->is_array() || static_cast<int64_t>(it->size()) != m.num_layers) {
    return r.KeyError("layer_types", fmt::format("expected a list of {} layer types (one per layer)", m.num_layers));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& t = (*it)[i];
    if (!t.is_string() || (t.get<std::string>() != "sliding_attention" && t.get<std::string>() != "full_attention")) {
      return r.KeyError("layer_types", fmt::format("entry {} is not \"sliding_attention\" or \"full_attention\"", i));
    }
    m.layer_sliding[i] = t.get<std::string>() == "sliding_attention";
  }
  return {};
}

std::vector<ParamOp> QkNorms(const ModelSpec& m, bool per_head) {
  ParamOp q_norm{ParamOp::Kind::kNorm, "self_attn.q_norm", 0, per_head ? m.head_dim : m.num_heads * m.head_dim};
  q_norm.qk_norm = true;
  q_norm.head_norm = per_head;
  ParamOp k_norm = q_norm;
  k_norm.module = "self_attn.k_norm";
  k_norm.out = per_head ? m.head_dim : m.num_kv_heads * m.head_dim;
  return {q_norm, k_norm};
}

void AddHeadQkNorms(const ModelSpec& m, std::vector<ParamOp>& block) {
  const std::vector<ParamOp> norms = QkNorms(m, true);
  block.insert(block.end() - 1, norms.begin(), norms.end());
}

void AddGatedMlp(const ModelSpec& m, bool bias, std::vector<ParamOp>& block) {
  const int64_t h = m.hidden_size, inner = m.intermediate_size;
  block.push_back({ParamOp::Kind::kLinear, "mlp.gate_proj", h, inner, bias});
  block.push_back({ParamOp::Kind::kLinear, "mlp.up_proj", h, inner, bias});
  block.push_back({ParamOp::Kind::kLinear, "mlp.down_proj", inner, h, bias});
}

void AddFusedExperts(const ModelSpec& m, std::vector<ParamOp>& block, const FusedExpertsLayout& layout) {
  const int64_t h = m.hidden_size, inner = m.intermediate_size, e = m.num_experts, k = m.experts_per_token;
  block.push_back({ParamOp::Kind::kRouter, layout.router, h, e, layout.biases});
  ParamOp gate_up{ParamOp::Kind::kLinear, std::string(layout.experts) + ".gate_up_proj", h, 2 * inner, layout.biases, layout.transposed, e, k};
  gate_up.fused_experts = true;
  gate_up.dense_dispatch = layout.dense_dispatch;
  ParamOp down = gate_up;
  down.module = std::string(layout.experts) + ".down_proj";
  down.in = inner;
  down.out = h;
  block.insert(block.end(), {gate_up, down});
}

}  // namespace fsdp::families
