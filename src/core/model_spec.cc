#include "core/model_spec.h"

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <functional>

#include <fmt/format.h>

#include "core/catalog.h"
#include "core/families/family.h"
#include "core/limits.h"
#include "core/lora.h"

namespace fsdp {
namespace {

void AddTensor(std::vector<TensorSpec>& out, std::string name, std::vector<int64_t> shape, int block, bool in_linear, double share = 1.0,
               bool trainable = true) {
  out.push_back(TensorSpec{std::move(name), std::move(shape), block, in_linear, trainable, share});
}

void AddNorm(std::vector<TensorSpec>& out, NormKind kind, const std::string& module, int64_t dim, int block, bool trainable = true) {
  AddTensor(out, module + ".weight", {dim}, block, false, 1.0, trainable);
  if (kind == NormKind::kLayer) AddTensor(out, module + ".bias", {dim}, block, false, 1.0, trainable);
}

void AddOp(std::vector<TensorSpec>& out, NormKind norm, const ParamOp& op, const std::string& module, int block) {
  if (op.kind == ParamOp::Kind::kNorm) {
    AddNorm(out, norm, module, op.out, block, op.trainable);
    return;
  }
  if (op.kind == ParamOp::Kind::kParameter) {
    AddTensor(out, module, op.shape.empty() ? std::vector<int64_t>{op.out} : op.shape, block, false, 1.0, op.trainable);
    return;
  }
  const double share = op.experts > 0 ? static_cast<double>(op.experts_per_token) / static_cast<double>(op.experts) : 1.0;
  // peft's lora.Linear holds the wrapped module as base_layer, registered before its adapters
  const std::string base = op.lora_rank > 0 ? module + std::string(kLoraBaseLayer) : module;
  if (op.nf4_storage_bytes > 0) {
    // Params4bit of bitsandbytes' quantize_4bit: ((n + 1) // (2 x itemsize), 1) elements of the quant storage
    const int64_t n = op.in * op.out;
    AddTensor(out, base + ".weight", {(n + 1) / (2 * op.nf4_storage_bytes), 1}, block, true, share, op.trainable);
    out.back().nf4_numel = n;
  } else {
    AddTensor(out, base + ".weight", op.conv1d ? std::vector<int64_t>{op.in, op.out} : std::vector<int64_t>{op.out, op.in}, block, true, share,
              op.trainable);
  }
  if (op.bias) AddTensor(out, base + ".bias", {op.out}, block, true, share, op.trainable);
  if (op.lora_rank > 0) {
    AddTensor(out, module + std::string(kLoraASuffix), {op.lora_rank, op.in}, block, true, share);
    AddTensor(out, module + std::string(kLoraBSuffix), {op.out, op.lora_rank}, block, true, share);
  }
}

// A block's modules; a run of expert modules is expanded expert by expert (experts.0.w1, .w3, .w2,
// experts.1.w1, ...), as the checkpoints order them.
void AddBlock(std::vector<TensorSpec>& out, const Architecture& a, const std::string& prefix, int block) {
  const std::vector<ParamOp>& ops = a.BlockOf(block);
  for (size_t i = 0; i < ops.size();) {
    const ParamOp& op = ops[i];
    if (op.experts == 0) {
      AddOp(out, a.norm, op, prefix + op.module, block);
      ++i;
      continue;
    }
    if (op.fused_experts) {
      const double share = static_cast<double>(op.experts_per_token) / static_cast<double>(op.experts);
      AddTensor(out, prefix + op.module, op.conv1d ? std::vector<int64_t>{op.experts, op.in, op.out} : std::vector<int64_t>{op.experts, op.out, op.in},
                block, true, share, op.trainable);
      out.back().dense_dispatch = op.dense_dispatch;
      if (op.bias) AddTensor(out, prefix + op.module + "_bias", {op.experts, op.out}, block, false, share, op.trainable);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < ops.size() && ops[end].experts == op.experts && !ops[end].fused_experts) ++end;
    for (int64_t e = 0; e < op.experts; ++e) {
      for (size_t j = i; j < end; ++j) {
        std::string module = ops[j].module;
        module.replace(module.find("{}"), 2, std::to_string(e));
        AddOp(out, a.norm, ops[j], prefix + module, block);
      }
    }
    i = end;
  }
}

Result<const families::Family*> FamilyOf(const std::string& model_type, const std::string& origin) {
  if (const families::Family* f = families::FindFamily(model_type)) return f;
  std::string supported;
  for (const families::Family& f : families::Families()) supported += (supported.empty() ? "" : ", ") + std::string(f.model_type);
  return Error::BadInput(fmt::format("{}: key 'model_type': unsupported model type '{}' (supported: {})", origin, model_type, supported));
}

// The vision tower's tensors (image_only), requiring grad as their ops say.
void AddVisionTower(std::vector<TensorSpec>& out, const VisionTower& v) {
  const size_t first = out.size();
  for (const ParamOp& op : v.before) AddOp(out, v.norm, op, op.module, -1);
  for (int64_t l = 0; l < v.num_layers; ++l) {
    for (const ParamOp& op : v.layer) AddOp(out, v.norm, op, fmt::format("{}.{}.{}", v.layers, l, op.module), -1);
  }
  for (const ParamOp& op : v.after) AddOp(out, v.norm, op, op.module, -1);
  for (size_t i = first; i < out.size(); ++i) {
    out[i].image_only = true;
    out[i].requires_grad = out[i].trainable;  // frozen ops (LoRA's base) say so themselves
  }
}

// Tensors and parameters of one op (a norm of `norm`'s kind).
InventorySize OpSize(const ParamOp& op, NormKind norm) {
  if (op.kind == ParamOp::Kind::kNorm) {
    const double dim = static_cast<double>(op.out);
    return norm == NormKind::kLayer ? InventorySize{2, 2 * dim} : InventorySize{1, dim};
  }
  if (op.kind == ParamOp::Kind::kParameter) {
    double n = 1;
    for (int64_t d : op.shape) n *= static_cast<double>(d);
    return {1, op.shape.empty() ? static_cast<double>(op.out) : n};
  }
  InventorySize one{op.bias ? 2.0 : 1.0, static_cast<double>(op.in) * static_cast<double>(op.out) + (op.bias ? static_cast<double>(op.out) : 0.0)};
  if (op.lora_rank > 0) {
    one.tensors += 2;
    one.params += static_cast<double>(op.lora_rank) * static_cast<double>(op.in + op.out);
  }
  return one;
}

InventorySize VisionTowerSize(const VisionTower& v) {
  InventorySize total, layer;
  for (const ParamOp& op : v.layer) { const InventorySize s = OpSize(op, v.norm); layer.tensors += s.tensors; layer.params += s.params; }
  total.tensors = layer.tensors * static_cast<double>(v.num_layers);
  total.params = layer.params * static_cast<double>(v.num_layers);
  for (const std::vector<ParamOp>* ops : {&v.before, &v.after}) {
    for (const ParamOp& op : *ops) { const InventorySize s = OpSize(op, v.norm); total.tensors += s.tensors; total.params += s.params; }
  }
  return total;
}

}  // namespace

std::vector<TensorSpec> BuildInventory(const ModelSpec& m) {
  const Architecture& a = m.arch;
  const int64_t h = m.hidden_size;
  std::vector<TensorSpec> out;
  const bool train = !a.base_frozen;
  AddVisionTower(out, a.vision);
  AddTensor(out, a.names.embedding + ".weight", {m.vocab_size, h}, -1, false, 1.0, train);
  if (!a.names.positions.empty()) AddTensor(out, a.names.positions + ".weight", {m.max_position_embeddings, h}, -1, false, 1.0, train);
  for (int b = 0; b < m.num_layers; ++b) AddBlock(out, a, fmt::format("{}.{}.", a.names.blocks, b), b);
  AddNorm(out, a.norm, a.names.final_norm, h, -1, train);
  if (!m.tie_word_embeddings) AddTensor(out, a.names.lm_head + ".weight", {m.vocab_size, h}, -1, true, 1.0, train);
  return out;
}

InventorySize CountInventory(const ModelSpec& m) {
  const Architecture& a = m.arch;
  const double h = static_cast<double>(m.hidden_size);
  auto norm = [&](double dim) { return a.norm == NormKind::kLayer ? InventorySize{2, 2 * dim} : InventorySize{1, dim}; };
  auto block_size = [&](const std::vector<ParamOp>& ops) {
    InventorySize block;
    for (const ParamOp& op : ops) {
      const InventorySize one = OpSize(op, a.norm);
      const double copies = op.experts > 0 ? static_cast<double>(op.experts) : 1.0;
      block.tensors += op.fused_experts ? (op.bias ? 2 : 1) : one.tensors * copies;
      block.params += one.params * copies;
    }
    return block;
  };
  const double dense = static_cast<double>(std::count(a.dense_layers.begin(), a.dense_layers.end(), true));
  const InventorySize routed = block_size(a.block), dense_block = block_size(a.dense_block);
  const double layers = static_cast<double>(m.num_layers) - dense;
  const InventorySize block{routed.tensors * layers + dense_block.tensors * dense, routed.params * layers + dense_block.params * dense};
  const double vocab = static_cast<double>(m.vocab_size);
  const InventorySize vision = VisionTowerSize(a.vision);
  InventorySize total{vision.tensors + block.tensors + 1, vision.params + block.params + vocab * h};
  if (!a.names.positions.empty()) { total.tensors += 1; total.params += static_cast<double>(m.max_position_embeddings) * h; }
  total.tensors += norm(h).tensors;
  total.params += norm(h).params;
  if (!m.tie_word_embeddings) { total.tensors += 1; total.params += vocab * h; }
  return total;
}

ModelShape ModelShape::LayerShape(int block) const {
  ModelShape shape = *this;
  if (LayerWithoutRope(block)) shape.nope = true;
  shape.layer_nope.clear();
  if (!arch.DenseLayer(block)) return shape;
  shape.arch.block = arch.dense_block;
  shape.arch.dense_block.clear();
  shape.arch.dense_layers.clear();
  shape.arch.mlp = MlpKind::kGated;
  shape.num_experts = shape.experts_per_token = 0;
  for (const ParamOp& op : arch.dense_block) {
    if (op.module.ends_with(".down_proj")) shape.intermediate_size = op.in;
  }
  return shape;
}

int64_t ModelShape::WindowOf(int block) const {
  if (sliding_window == 0 || layer_sliding.empty()) return sliding_window;
  return layer_sliding.at(static_cast<size_t>(block)) ? sliding_window : 0;
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorSpec::module() const {
  auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

int64_t ModelSpec::ParamsTrainable() const {
  int64_t n = 0;
  for (const TensorSpec& t : tensors) n += t.RequiresGrad() ? t.LogicalNumel() : 0;
  return n;
}

int64_t ModelSpec::ParamsTotal() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.LogicalNumel();
  return total;
}

int64_t ModelSpec::BlockParams(int block) const {
  int64_t total = 0;
  for (const auto& t : tensors) if (t.block == block) total += t.LogicalNumel();
  return total;
}

int64_t ModelSpec::VisionParams() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.image_only ? t.LogicalNumel() : 0;
  return total;
}

int64_t ModelSpec::ActiveParamsPerToken() const {
  double active = 0;
  for (const TensorSpec& t : tensors) active += t.image_only ? 0.0 : static_cast<double>(t.LogicalNumel()) * t.active_share;
  return std::llround(active);
}

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
  if (Status s = family.value()->read(r, m); !s.ok()) return s.error();
  const InventorySize size = CountInventory(m);
  if (size.tensors > limits::kMaxTensors || size.params > limits::kMaxParams) {
    return Error::BadInput(fmt::format("{}: {} layers of {} would have {:.3g} parameter tensors and {:.3g} parameters; the most a model may have "
                                       "is {:.0e} tensors and {:.0e} parameters", origin, m.num_layers, m.model_type, size.tensors, size.params,
                                       limits::kMaxTensors, limits::kMaxParams));
  }
  m.tensors = BuildInventory(m);
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
