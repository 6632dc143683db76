#include "core/lora.h"

#include <algorithm>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace fsdp {
namespace {

constexpr const char* kAllLinear = "all-linear";  // peft's INCLUDE_LINEAR_LAYERS_SHORTHAND

// Every block shape's modules: the one most layers run, then the dense layers' (Architecture::dense_block).
std::vector<const ParamOp*> BlockOps(const Architecture& a) {
  std::vector<const ParamOp*> ops;
  for (const std::vector<ParamOp>* block : {&a.block, &a.dense_block}) {
    for (const ParamOp& op : *block) ops.push_back(&op);
  }
  return ops;
}

// A vision tower's modules (Architecture::vision): its layer's, with paths relative to a layer,
// and those before and after the layers, with full paths.
template <class Tower, class Op = std::conditional_t<std::is_const_v<Tower>, const ParamOp, ParamOp>>
std::vector<Op*> VisionOps(Tower& v) {
  std::vector<Op*> ops;
  for (auto* part : {&v.before, &v.layer, &v.after}) {
    for (Op& op : *part) ops.push_back(&op);
  }
  return ops;
}

// peft matches target_modules against every module of the model, so a vision tower's linears whose
// path ends with a target (SigLIP's q/k/v_proj, out_proj, fc1, fc2) get adapters too, and
// all-linear adapts all of them (CTest hf_lora_param_count.gemma3); everything else there is frozen.
Status AdaptVisionTower(ModelSpec& m, const LoraConfig& lora) {
  VisionTower& v = m.arch.vision;
  if (!v.present()) return {};
  if (lora.qlora) {
    return Error::BadInput(fmt::format("--qlora on {}: bitsandbytes would quantize its vision tower's linears too, which fsdpkit does not model; "
                                       "fsdpkit models QLoRA on text-only models", m.id));
  }
  const std::vector<std::string> targets = lora.targets.empty() ? m.arch.lora_default_targets : SplitTargets(lora.targets);
  const bool all_linear = targets.size() == 1 && targets[0] == kAllLinear;
  for (ParamOp* op : VisionOps(v)) {
    op->trainable = false;
    if (op->kind != ParamOp::Kind::kLinear) continue;
    if (!all_linear && std::none_of(targets.begin(), targets.end(), [&](const std::string& t) { return ModulePathMatches(op->module, t); })) continue;
    if (lora.rank > std::min(op->in, op->out)) {
      return Error::BadInput(fmt::format("--lora-rank {} exceeds the width of {}'s vision {} ({} x {}): a rank is at most min(in, out) = {}",
                                         lora.rank, m.id, op->module, op->in, op->out, std::min(op->in, op->out)));
    }
    op->lora_rank = lora.rank;
    op->lora_dropout = lora.dropout;
  }
  return {};
}

std::string LinearNames(const ModelSpec& m) {
  std::vector<std::string> names;
  for (const ParamOp* op : BlockOps(m.arch)) {
    if (op->kind == ParamOp::Kind::kLinear && op->experts == 0 && std::find(names.begin(), names.end(), op->module) == names.end()) {
      names.push_back(op->module);
    }
  }
  return fmt::format("{}", fmt::join(names, ", "));
}

// peft's get_peft_model on one module: frozen, LoRA-wrapped when targeted, its weight NF4 under QLoRA.
void FreezeAndAdapt(ParamOp& op, const LoraConfig& lora, const std::vector<std::string>& modules, DType quant_storage) {
  op.trainable = false;
  if (lora.qlora && op.kind == ParamOp::Kind::kLinear) {
    op.nf4_storage_bytes = BytesPerElement(quant_storage);
    op.nf4_double_quant = lora.double_quant;
  }
  if (std::find(modules.begin(), modules.end(), op.module) != modules.end()) {
    op.lora_rank = lora.rank;
    op.lora_dropout = lora.dropout;
  }
}

}  // namespace

bool ModulePathMatches(std::string_view path, std::string_view name) {
  return path == name || (path.size() > name.size() && path.ends_with(name) && path[path.size() - name.size() - 1] == '.');
}

std::vector<std::string> SplitTargets(const std::string& targets) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= targets.size()) {
    size_t comma = targets.find(',', start);
    if (comma == std::string::npos) comma = targets.size();
    std::string item = targets.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

Result<std::vector<std::string>> LoraTargetModules(const ModelSpec& m, const LoraConfig& lora) {
  if (lora.targets.empty() && m.arch.lora_default_targets.empty()) {
    // peft's _prepare_adapter_config: "Please specify `target_modules` in `peft_config`"
    return Error::BadInput(fmt::format("--lora-rank on {}: peft 0.21 has no default target modules for model type '{}'; name them "
                                       "with --lora-targets (LoRA wraps: {})", m.id, m.model_type, LinearNames(m)));
  }
  const std::vector<std::string> targets = lora.targets.empty() ? m.arch.lora_default_targets : SplitTargets(lora.targets);
  if (targets.empty()) return Error::BadInput("--lora-targets names no module");
  const bool all_linear = targets.size() == 1 && targets[0] == kAllLinear;
  if (all_linear && m.num_experts > 0) {
    return Error::BadInput(fmt::format("--lora-targets: all-linear on {}: peft also adapts its routed experts (their fused 3-D parameters), "
                                       "which fsdpkit does not model; name the modules (LoRA wraps: {})",
                                       m.id, LinearNames(m)));
  }
  std::vector<std::string> modules;
  for (const std::string& target : targets) {
    if (all_linear) break;
    if (target == kAllLinear) return Error::BadInput("--lora-targets: all-linear stands alone, not in a list");
    bool found = false;
    const ParamOp* bare = nullptr;
    for (const ParamOp* p : BlockOps(m.arch)) {
      const ParamOp& op = *p;
      if (!ModulePathMatches(op.module, target)) continue;
      if (op.dense_dispatch) continue;  // Llama 4's experts: peft 0.21 leaves them alone (hf_lora_param_count)
      found = true;
      if (op.kind == ParamOp::Kind::kNorm) {
        return Error::BadInput(fmt::format("--lora-targets: '{}' is a norm of {}'s blocks, not a linear (LoRA wraps: {})", target, m.id, LinearNames(m)));
      }
      if (op.kind == ParamOp::Kind::kRouter || op.experts > 0) bare = &op;
    }
    // peft 0.21 converts a target for transformers 5's fused experts by its last component
    // (transformers_weight_conversion.py), so "shared_experts.down_proj" adapts the routed
    // experts' down_proj too (hf_lora_param_count: their LoRA parameters appear)
    const std::string_view last = std::string_view(target).substr(target.rfind('.') + 1);
    for (const ParamOp* p : found && bare == nullptr ? BlockOps(m.arch) : std::vector<const ParamOp*>{}) {
      if (p->fused_experts && !p->dense_dispatch && std::string_view(p->module).substr(p->module.rfind('.') + 1) == last) bare = p;
    }
    if (bare != nullptr) {
      return Error::BadInput(fmt::format("--lora-targets: '{}' is {}'s {}: a bare parameter in transformers 5 (peft adapts it through "
                                         "target_parameters), which fsdpkit does not model (LoRA wraps: {})",
                                         target, m.id, bare->kind == ParamOp::Kind::kRouter ? "router" : "routed experts", LinearNames(m)));
    }
    const ModuleNames& names = m.arch.names;
    if (!found && (ModulePathMatches(names.lm_head, target) || ModulePathMatches(names.embedding, target))) {
      return Error::BadInput(fmt::format("--lora-targets: '{}' is outside the decoder blocks; fsdpkit models LoRA on the blocks' linears only "
                                         "(LoRA wraps: {}, or all-linear)", target, LinearNames(m)));
    }
    if (!found) {
      return Error::BadInput(fmt::format("--lora-targets: '{}' names no module of {}'s decoder blocks (LoRA wraps: {}, or all-linear)", target,
                                         m.id, LinearNames(m)));
    }
  }
  for (const ParamOp* p : BlockOps(m.arch)) {
    const ParamOp& op = *p;
    if (op.kind != ParamOp::Kind::kLinear || op.experts > 0) continue;
    const bool hit = all_linear || std::any_of(targets.begin(), targets.end(), [&](const std::string& t) { return ModulePathMatches(op.module, t); });
    if (!hit) continue;
    if (lora.rank > std::min(op.in, op.out)) {
      return Error::BadInput(fmt::format("--lora-rank {} exceeds the width of {}'s {} ({} x {}): a rank is at most min(in, out) = {}", lora.rank,
                                         m.id, op.module, op.in, op.out, std::min(op.in, op.out)));
    }
    if (std::find(modules.begin(), modules.end(), op.module) == modules.end()) modules.push_back(op.module);
  }
  return modules;
}

std::vector<std::string> AdaptedModules(const Architecture& a) {
  std::vector<std::string> modules;
  std::vector<const ParamOp*> ops = BlockOps(a);
  for (const ParamOp* op : VisionOps(a.vision)) ops.push_back(op);
  for (const ParamOp* op : ops) {
    if (op->lora_rank > 0 && std::find(modules.begin(), modules.end(), op->module) == modules.end()) modules.push_back(op->module);
  }
  return modules;
}

// bitsandbytes 0.50 functional.py: quantize_4bit (blocksize 64; get_4bit_type's 16-entry code;
// with compress_statistics the fp32 absmax's mean as offset, and quantize_blockwise of the absmax
// in blocks of 256, whose state copies the 256-entry dynamic map: code.to(A.device, copy=True))
std::vector<int64_t> Nf4QuantStateTensorBytes(int64_t n, bool double_quant) {
  constexpr int64_t kBlock = 64, kNestedBlock = 256, kCodeBytes = 16 * 4, kDynamicMapBytes = 256 * 4;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (!double_quant) return {blocks * 4, kCodeBytes};
  return {kCodeBytes, 4, blocks, (blocks + kNestedBlock - 1) / kNestedBlock * 4, kDynamicMapBytes};
}

int64_t Nf4QuantStateBytes(int64_t n, bool double_quant) {
  int64_t total = 0;
  for (int64_t b : Nf4QuantStateTensorBytes(n, double_quant)) total += b;
  return total;
}

Nf4Bytes Nf4ModelBytes(const ModelSpec& m, const LoraConfig& lora, DType quant_storage) {
  Nf4Bytes bytes;
  for (const TensorSpec& t : m.tensors) {
    if (t.nf4_numel == 0) continue;
    bytes.packed += t.numel() * BytesPerElement(quant_storage);
    bytes.quant_state += Nf4QuantStateBytes(t.nf4_numel, lora.double_quant);
  }
  return bytes;
}

int64_t Nf4EngineStateBytes(int64_t n, bool double_quant) {
  const int64_t blocks = (n + 63) / 64;
  return double_quant ? blocks + (blocks + 255) / 256 * 4 + 4 : blocks * 4;
}

int64_t Nf4ComputeNumel(const ModelSpec& m, const std::vector<int>& unit_tensors) {
  int64_t numel = 0;
  bool quantized = false;
  for (int t : unit_tensors) {
    const TensorSpec& ts = m.tensors[static_cast<size_t>(t)];
    quantized = quantized || ts.nf4_numel > 0;
    if (!IsLoraAdapter(ts.name)) numel += ts.LogicalNumel();
  }
  return quantized ? numel : 0;
}

Status ApplyLora(ModelSpec& m, const LoraConfig& lora, DType quant_storage) {
  if (lora.rank == 0) return {};
  if (lora.qlora && m.num_experts > 0) {
    return Error::BadInput(fmt::format("--qlora on {}: transformers 5 stores its routed experts as fused 3-D parameters, which bitsandbytes' "
                                       "Linear4bit does not replace; fsdpkit models QLoRA on dense models", m.id));
  }
  FSDP_ASSIGN_OR_RETURN(const std::vector<std::string> modules, LoraTargetModules(m, lora));
  for (ParamOp& op : m.arch.block) FreezeAndAdapt(op, lora, modules, quant_storage);
  for (ParamOp& op : m.arch.dense_block) FreezeAndAdapt(op, lora, modules, quant_storage);
  FSDP_TRY(AdaptVisionTower(m, lora));
  m.arch.base_frozen = true;
  m.tensors = BuildInventory(m);
  return {};
}

}  // namespace fsdp
