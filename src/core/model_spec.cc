#include "core/model_spec.h"

#include <filesystem>
#include <functional>

#include <fmt/format.h>

#include "core/catalog.h"

namespace fsdp {
namespace {

// Upper bounds that no real checkpoint comes near; beyond them a value is a typo.
constexpr int64_t kMaxDim = 1 << 20;
constexpr int64_t kMaxLayers = 10000;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxVocab = 16 << 20;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

// Defaults of transformers' configuration_<type>.py for keys a config may omit.
struct HfDefaults {
  int64_t vocab_size, hidden_size, intermediate_size, num_layers, num_heads;
  int64_t num_kv_heads;  // 0 = same as num_heads
  int64_t max_position_embeddings;
  bool tie_word_embeddings;
  double rms_norm_eps;  // GPT-2: layer_norm_epsilon
  double rope_theta;    // GPT-2: unused (learned positions)
};

HfDefaults DefaultsFor(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama: return {32000, 4096, 11008, 32, 32, 0, 2048, false, 1e-6, 10000.0};
    case ModelFamily::kMistral: return {32000, 4096, 14336, 32, 32, 8, 4096 * 32, false, 1e-6, 10000.0};
    case ModelFamily::kMixtral: return {32000, 4096, 14336, 32, 32, 8, 4096 * 32, false, 1e-5, 1e6};
    case ModelFamily::kQwen2: return {151936, 4096, 22016, 32, 32, 32, 32768, false, 1e-6, 10000.0};
    case ModelFamily::kGpt2: return {50257, 768, 0, 12, 12, 0, 1024, true, 1e-5, 0.0};
  }
  return {};
}

Result<ModelFamily> FamilyOf(const std::string& model_type, const std::string& origin) {
  if (model_type == "llama") return ModelFamily::kLlama;
  if (model_type == "mistral") return ModelFamily::kMistral;
  if (model_type == "mixtral") return ModelFamily::kMixtral;
  if (model_type == "qwen2") return ModelFamily::kQwen2;
  if (model_type == "gpt2") return ModelFamily::kGpt2;
  return Error::BadInput(fmt::format("{}: key 'model_type': unsupported model type '{}' (supported: llama, mistral, mixtral, qwen2, gpt2)", origin, model_type));
}

// Reads an integer key (or the first of several alias keys) with a default and a valid range.
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

// Reads a positive real key with a default; values outside (0, max_value] are typos.
Result<double> ReadPositive(const JsonReader& reader, const char* key, double fallback, double max_value) {
  auto v = reader.OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return fallback;
  const double x = *v.value();
  if (!(x > 0 && x <= max_value)) return reader.KeyError(key, fmt::format("must be positive and at most {}, got {}", max_value, x));
  return x;
}

Result<bool> ReadFlag(const JsonReader& reader, const char* key, bool fallback) {
  auto v = reader.OptionalBool(key);
  if (!v.ok()) return v.error();
  return v.value().value_or(fallback);
}

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
  if (!(high.value() > low.value())) {
    return s.KeyError("high_freq_factor", fmt::format("must exceed low_freq_factor {}, got {}", low.value(), high.value()));
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
Status ReadRope(const JsonReader& r, ModelSpec& m) {
  auto object = RopeObject(r);
  if (!object.ok()) return object.error();
  auto theta = ReadPositive(r, "rope_theta", DefaultsFor(m.family).rope_theta, 1e12);
  if (!theta.ok()) return theta.error();
  m.rope_theta = theta.value();
  if (!object.value()) return {};
  auto inner = ReadPositive(*object.value(), "rope_theta", m.rope_theta, 1e12);
  if (!inner.ok()) return inner.error();
  m.rope_theta = inner.value();
  return ReadRopeScaling(*object.value(), m.max_position_embeddings, m.rope_scaling);
}

// Reads the hyper-parameters common to all families into `m`.
Status ReadHyperParameters(const JsonReader& r, ModelSpec& m) {
  const HfDefaults d = DefaultsFor(m.family);
  const bool gpt2 = m.family == ModelFamily::kGpt2;
  auto set = [](int64_t& field, Result<int64_t> v) -> Status {
    if (!v.ok()) return v.error();
    field = v.value();
    return {};
  };
  Status s;
  if (!(s = set(m.vocab_size, ReadDim(r, {"vocab_size"}, d.vocab_size, kMaxVocab))).ok()) return s;
  if (!(s = set(m.hidden_size, ReadDim(r, gpt2 ? std::initializer_list<const char*>{"n_embd", "hidden_size"} : std::initializer_list<const char*>{"hidden_size"}, d.hidden_size, kMaxDim))).ok()) return s;
  if (!(s = set(m.num_layers, ReadDim(r, gpt2 ? std::initializer_list<const char*>{"n_layer", "num_hidden_layers"} : std::initializer_list<const char*>{"num_hidden_layers"}, d.num_layers, kMaxLayers))).ok()) return s;
  if (!(s = set(m.num_heads, ReadDim(r, gpt2 ? std::initializer_list<const char*>{"n_head", "num_attention_heads"} : std::initializer_list<const char*>{"num_attention_heads"}, d.num_heads, kMaxDim))).ok()) return s;
  if (!(s = set(m.max_position_embeddings, ReadDim(r, gpt2 ? std::initializer_list<const char*>{"n_positions", "max_position_embeddings"} : std::initializer_list<const char*>{"max_position_embeddings"}, d.max_position_embeddings, kMaxPositions))).ok()) return s;
  if (gpt2) {
    if (!(s = set(m.intermediate_size, ReadDim(r, {"n_inner"}, 4 * m.hidden_size, kMaxDim))).ok()) return s;
    m.num_kv_heads = m.num_heads;
  } else {
    if (!(s = set(m.intermediate_size, ReadDim(r, {"intermediate_size"}, d.intermediate_size, kMaxDim))).ok()) return s;
    int64_t kv_default = d.num_kv_heads == 0 ? m.num_heads : d.num_kv_heads;
    if (!(s = set(m.num_kv_heads, ReadDim(r, {"num_key_value_heads"}, kv_default, kMaxDim))).ok()) return s;
  }
  auto head_dim = ReadDim(r, {"head_dim"}, 0, kMaxDim);
  if (!head_dim.ok()) return head_dim.error();
  if (head_dim.value() == 0) {
    if (m.hidden_size % m.num_heads != 0) {
      return Error::BadInput(fmt::format("{}: hidden size {} is not divisible by {} attention heads (and no head_dim is given)", r.origin(), m.hidden_size, m.num_heads));
    }
    m.head_dim = m.hidden_size / m.num_heads;
  } else {
    m.head_dim = head_dim.value();
  }
  if (m.num_heads % m.num_kv_heads != 0) {
    return Error::BadInput(fmt::format("{}: {} attention heads are not divisible by {} key/value heads", r.origin(), m.num_heads, m.num_kv_heads));
  }
  auto eps = ReadPositive(r, gpt2 ? "layer_norm_epsilon" : "rms_norm_eps", d.rms_norm_eps, 0.1);
  if (!eps.ok()) return eps.error();
  m.norm_eps = eps.value();
  m.rope_theta = d.rope_theta;  // GPT-2: 0, learned positions
  if (!gpt2) return ReadRope(r, m);
  return {};
}

// `sliding_window`: 4096 when absent (MistralConfig's and Qwen2Config's default), 0 (no window)
// when null, as Mistral v0.2+ and Qwen2 write it.
Result<int64_t> ReadSlidingWindow(const JsonReader& r) {
  const auto it = r.json().find("sliding_window");
  if (it != r.json().end() && it->is_null()) return int64_t{0};
  return ReadDim(r, {"sliding_window"}, 4096, kMaxPositions);
}

// Reads tie/bias/MoE/dropout flags with each family's rules.
Status ReadFamilyRules(const JsonReader& r, ModelSpec& m) {
  const HfDefaults d = DefaultsFor(m.family);
  auto tie = ReadFlag(r, "tie_word_embeddings", d.tie_word_embeddings);
  if (!tie.ok()) return tie.error();
  m.tie_word_embeddings = tie.value();
  switch (m.family) {
    case ModelFamily::kGpt2: {
      m.qkv_bias = m.o_bias = m.mlp_bias = true;
      m.layer_norm = true;
      auto act = r.OptionalString("activation_function");
      if (!act.ok()) return act.error();
      m.activation = act.value().value_or("gelu_new");
      auto a = ReadProbability(r, "attn_pdrop", 0.1), res = ReadProbability(r, "resid_pdrop", 0.1), e = ReadProbability(r, "embd_pdrop", 0.1);
      if (!a.ok()) return a.error();
      if (!res.ok()) return res.error();
      if (!e.ok()) return e.error();
      m.attention_dropout = a.value(); m.residual_dropout = res.value(); m.embedding_dropout = e.value();
      return {};
    }
    case ModelFamily::kQwen2: {
      m.qkv_bias = true;  // Qwen2Attention: q/k/v Linear(bias=True), o_proj bias=False
      auto use_window = ReadFlag(r, "use_sliding_window", false);  // Qwen2Config: off; then layers from max_window_layers on
      if (!use_window.ok()) return use_window.error();
      if (use_window.value()) {
        auto window = ReadSlidingWindow(r);
        if (!window.ok()) return window.error();
        m.sliding_window = window.value();
      }
      break;
    }
    case ModelFamily::kLlama: {
      auto ab = ReadFlag(r, "attention_bias", false), mb = ReadFlag(r, "mlp_bias", false);
      if (!ab.ok()) return ab.error();
      if (!mb.ok()) return mb.error();
      m.qkv_bias = m.o_bias = ab.value();
      m.mlp_bias = mb.value();
      break;
    }
    case ModelFamily::kMixtral: {
      auto e = ReadDim(r, {"num_local_experts"}, 8, kMaxExperts), k = ReadDim(r, {"num_experts_per_tok"}, 2, kMaxExperts);
      if (!e.ok()) return e.error();
      if (!k.ok()) return k.error();
      m.num_experts = e.value();
      m.experts_per_token = k.value();
      if (m.experts_per_token > m.num_experts) {
        return Error::BadInput(fmt::format("{}: num_experts_per_tok {} exceeds num_local_experts {}", r.origin(), m.experts_per_token, m.num_experts));
      }
      break;
    }
    case ModelFamily::kMistral: {
      auto window = ReadSlidingWindow(r);
      if (!window.ok()) return window.error();
      m.sliding_window = window.value();
      break;
    }
  }
  auto act = r.OptionalString("hidden_act");
  if (!act.ok()) return act.error();
  m.activation = act.value().value_or("silu");
  auto dropout = ReadProbability(r, "attention_dropout", 0.0);
  if (!dropout.ok()) return dropout.error();
  m.attention_dropout = dropout.value();
  return {};
}

void AddTensor(ModelSpec& m, std::string name, std::vector<int64_t> shape, int block, bool in_linear) {
  m.tensors.push_back(TensorSpec{std::move(name), std::move(shape), block, in_linear});
}

void AddLinear(ModelSpec& m, const std::string& module, int64_t out, int64_t in, bool bias, int block) {
  AddTensor(m, module + ".weight", {out, in}, block, true);
  if (bias) AddTensor(m, module + ".bias", {out}, block, true);
}

// Llama-family decoder: embed_tokens, layers.{i}.{input_layernorm, self_attn, post_attention_layernorm, mlp}, norm, lm_head.
void BuildLlamaInventory(ModelSpec& m) {
  const int64_t h = m.hidden_size, q_dim = m.num_heads * m.head_dim, kv_dim = m.num_kv_heads * m.head_dim;
  AddTensor(m, "model.embed_tokens.weight", {m.vocab_size, h}, -1, false);
  for (int b = 0; b < m.num_layers; ++b) {
    const std::string p = fmt::format("model.layers.{}", b);
    AddTensor(m, p + ".input_layernorm.weight", {h}, b, false);
    AddLinear(m, p + ".self_attn.q_proj", q_dim, h, m.qkv_bias, b);
    AddLinear(m, p + ".self_attn.k_proj", kv_dim, h, m.qkv_bias, b);
    AddLinear(m, p + ".self_attn.v_proj", kv_dim, h, m.qkv_bias, b);
    AddLinear(m, p + ".self_attn.o_proj", h, q_dim, m.o_bias, b);
    AddTensor(m, p + ".post_attention_layernorm.weight", {h}, b, false);
    const int64_t inner = m.intermediate_size;
    if (m.family == ModelFamily::kMixtral) {
      AddLinear(m, p + ".block_sparse_moe.gate", m.num_experts, h, false, b);
      for (int e = 0; e < m.num_experts; ++e) {
        const std::string ep = fmt::format("{}.block_sparse_moe.experts.{}", p, e);
        AddLinear(m, ep + ".w1", inner, h, false, b);
        AddLinear(m, ep + ".w3", inner, h, false, b);
        AddLinear(m, ep + ".w2", h, inner, false, b);
      }
    } else {
      AddLinear(m, p + ".mlp.gate_proj", inner, h, m.mlp_bias, b);
      AddLinear(m, p + ".mlp.up_proj", inner, h, m.mlp_bias, b);
      AddLinear(m, p + ".mlp.down_proj", h, inner, m.mlp_bias, b);
    }
  }
  AddTensor(m, "model.norm.weight", {h}, -1, false);
  if (!m.tie_word_embeddings) AddLinear(m, "lm_head", m.vocab_size, h, false, -1);
}

// GPT-2: transformer.{wte, wpe, h.{i}.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f}.
// Conv1D stores weights as [in, out].
void BuildGpt2Inventory(ModelSpec& m) {
  const int64_t h = m.hidden_size, inner = m.intermediate_size;
  AddTensor(m, "transformer.wte.weight", {m.vocab_size, h}, -1, false);
  AddTensor(m, "transformer.wpe.weight", {m.max_position_embeddings, h}, -1, false);
  auto conv1d = [&](const std::string& module, int64_t in, int64_t out, int block) {
    AddTensor(m, module + ".weight", {in, out}, block, true);
    AddTensor(m, module + ".bias", {out}, block, true);
  };
  for (int b = 0; b < m.num_layers; ++b) {
    const std::string p = fmt::format("transformer.h.{}", b);
    AddTensor(m, p + ".ln_1.weight", {h}, b, false);
    AddTensor(m, p + ".ln_1.bias", {h}, b, false);
    conv1d(p + ".attn.c_attn", h, 3 * h, b);
    conv1d(p + ".attn.c_proj", h, h, b);
    AddTensor(m, p + ".ln_2.weight", {h}, b, false);
    AddTensor(m, p + ".ln_2.bias", {h}, b, false);
    conv1d(p + ".mlp.c_fc", h, inner, b);
    conv1d(p + ".mlp.c_proj", inner, h, b);
  }
  AddTensor(m, "transformer.ln_f.weight", {h}, -1, false);
  AddTensor(m, "transformer.ln_f.bias", {h}, -1, false);
  if (!m.tie_word_embeddings) AddLinear(m, "lm_head", m.vocab_size, h, false, -1);
}

}  // namespace

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorSpec::module() const {
  auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

int64_t ModelSpec::ParamsTotal() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

int64_t ModelSpec::BlockParams(int block) const {
  int64_t total = 0;
  for (const auto& t : tensors) if (t.block == block) total += t.numel();
  return total;
}

int64_t ModelSpec::ActiveParamsPerToken() const {
  if (num_experts == 0) return ParamsTotal();
  const int64_t expert = 3 * hidden_size * intermediate_size;
  return ParamsTotal() - num_layers * (num_experts - experts_per_token) * expert;
}

std::string ModelSpec::BlockPrefix() const { return family == ModelFamily::kGpt2 ? "transformer.h" : "model.layers"; }

Result<ModelSpec> ModelFromHfConfig(const Json& config, const std::string& id, const std::string& origin) {
  if (!config.is_object()) return Error::BadInput(fmt::format("{}: expected a JSON object (a HuggingFace config.json)", origin));
  JsonReader r(config, origin);
  auto type = r.String("model_type");
  if (!type.ok()) return type.error();
  auto family = FamilyOf(type.value(), origin);
  if (!family.ok()) return family.error();
  ModelSpec m;
  m.id = id;
  m.model_type = type.value();
  m.family = family.value();
  if (Status s = ReadHyperParameters(r, m); !s.ok()) return s.error();
  if (Status s = ReadFamilyRules(r, m); !s.ok()) return s.error();
  if (m.family == ModelFamily::kGpt2) BuildGpt2Inventory(m); else BuildLlamaInventory(m);
  return m;
}

Result<ModelSpec> LoadModel(const std::string& id_or_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(id_or_path, ec)) {  // a downloaded model: its config.json
    std::filesystem::path dir = std::filesystem::path(id_or_path).lexically_normal();
    if (!dir.has_filename()) dir = dir.parent_path();  // "models/Llama-3.2-1B/" names the folder too
    const std::string config = (dir / "config.json").string();
    if (std::filesystem::is_regular_file(config, ec)) return LoadModel(config);
    // a folder that happens to share a catalog id's name does not hide the catalog
    if (id_or_path.find('/') != std::string::npos) return Error::BadInput(fmt::format("model directory '{}' has no config.json", id_or_path));
  }
  auto path = ResolveCatalogPath("models", "model", id_or_path);
  if (!path.ok()) return path.error();
  auto json = LoadJsonFile(path.value());
  if (!json.ok()) return json.error();
  std::filesystem::path file(path.value());
  // A Hub download is ".../<repo>/config.json": name it after its folder.
  std::string id = file.stem() == "config" && file.has_parent_path() ? file.parent_path().filename().string() : file.stem().string();
  return ModelFromHfConfig(json.value(), id, path.value());
}

}  // namespace fsdp
