#include "planner/export.h"

#include <doctest/doctest.h>

#include <regex>
#include <cctype>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/catalog.h"
#include "core/json_io.h"

namespace fsdp {
namespace {

// Exact names from the libraries' sources (tests/data/export_keys.json cites each).
Json Keys() {
  auto j = LoadJsonFile(DataDir() + "/tests/data/export_keys.json");
  REQUIRE(j.ok());
  return j.value();
}

std::set<std::string> Set(const Json& list) {
  std::set<std::string> out;
  for (const auto& v : list) out.insert(v.get<std::string>());
  return out;
}

// Keyword arguments of the first call `name(` in `code`, up to its matching parenthesis.
std::set<std::string> Kwargs(const std::string& code, const std::string& name) {
  size_t start = code.find(name + "(");
  REQUIRE_MESSAGE(start != std::string::npos, name);
  start += name.size() + 1;
  int depth = 1;
  size_t end = start;
  for (; end < code.size() && depth > 0; ++end) {
    if (code[end] == '(' || code[end] == '{') ++depth;
    if (code[end] == ')' || code[end] == '}') --depth;
  }
  std::string args = code.substr(start, end - start);
  std::set<std::string> out;
  // a keyword at nesting depth 0 of this call: preceded by '(' , ',' or a newline
  int level = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == '(' || args[i] == '{') ++level;
    if (args[i] == ')' || args[i] == '}') --level;
    if (level != 0 || !(std::isalpha(static_cast<unsigned char>(args[i])) || args[i] == '_')) continue;
    if (i > 0 && (std::isalnum(static_cast<unsigned char>(args[i - 1])) || args[i - 1] == '_' || args[i - 1] == '.')) continue;
    size_t j = i;
    while (j < args.size() && (std::isalnum(static_cast<unsigned char>(args[j])) || args[j] == '_')) ++j;
    if (j < args.size() && args[j] == '=' && (j + 1 >= args.size() || args[j + 1] != '=')) out.insert(args.substr(i, j - i));
    i = j - 1;  // the next character (maybe a parenthesis) is examined by the loop
  }
  return out;
}

Workload Plan(FsdpConfig c, const char* model = "llama-3.1-8b") {
  auto m = LoadModel(model);
  auto hw = LoadHardware("h100-sxm");
  REQUIRE(m.ok());
  auto w = BuildWorkload(m.value(), hw.value(), c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

void CheckSubset(const std::set<std::string>& used, const std::set<std::string>& allowed, const char* what) {
  for (const auto& k : used) {
    CAPTURE(std::string(what));
    CAPTURE(k);
    CHECK(allowed.count(k) == 1);
  }
}

TEST_CASE("FSDP1 export uses FullyShardedDataParallel's own argument and enum names") {
  Json keys = Keys();
  FsdpConfig c;
  c.gpus = 16;
  c.strategy = Strategy::kHybridShard;
  c.checkpointing = Checkpointing::kFull;
  const std::string code = ExportConfig(Plan(c), ExportFormat::kFsdp1);
  std::set<std::string> fsdp_args = Kwargs(code, "FSDP");
  CHECK(fsdp_args.count("sharding_strategy") == 1);
  CHECK(fsdp_args.count("limit_all_gathers") == 1);
  CheckSubset(fsdp_args, Set(keys["fsdp1_constructor_args"]) , "FSDP(...)");
  CheckSubset(Kwargs(code, "MixedPrecision"), Set(keys["mixed_precision_fields"]), "MixedPrecision");
  CheckSubset(Kwargs(code, "CPUOffload"), Set(keys["cpu_offload_fields"]), "CPUOffload");
  CHECK(code.find("ShardingStrategy.HYBRID_SHARD") != std::string::npos);
  CHECK(Set(keys["fsdp1_enums"]["ShardingStrategy"]).count("HYBRID_SHARD") == 1);
  CHECK(code.find("BackwardPrefetch.BACKWARD_PRE") != std::string::npos);
  CHECK(code.find("transformer_layer_cls={LlamaDecoderLayer}") != std::string::npos);
  CHECK(code.find("init_device_mesh(\"cuda\", (2, 8)") != std::string::npos);
  CHECK(code.find("apply_activation_checkpointing") != std::string::npos);
}

TEST_CASE("FSDP2 export uses fully_shard and MixedPrecisionPolicy names") {
  Json keys = Keys();
  FsdpConfig c;
  c.framework = Framework::kFsdp2;
  c.strategy = Strategy::kShardGradOp;
  const std::string code = ExportConfig(Plan(c), ExportFormat::kFsdp2);
  CheckSubset(Kwargs(code, "dict"), Set(keys["fsdp2_fully_shard_args"]), "fully_shard kwargs");
  CheckSubset(Kwargs(code, "MixedPrecisionPolicy"), Set(keys["fsdp2_mixed_precision_policy_fields"]), "MixedPrecisionPolicy");
  CHECK(code.find("reshard_after_forward=False") != std::string::npos);  // SHARD_GRAD_OP
  CHECK(code.find("fully_shard(model, **fsdp_kwargs)") != std::string::npos);
}

// A checkpointing policy accelerate and Lightning cannot express: their own checkpointing off,
// the code carried as comments (each of `yaml_lines` in the accelerate config, `lightning_line`
// in the Lightning arguments).
void CheckCheckpointingAsComments(const FsdpConfig& c, const std::vector<std::string>& yaml_lines, const std::string& lightning_line) {
  const std::string yaml = ExportConfig(Plan(c), ExportFormat::kAccelerate);
  CHECK(yaml.find("fsdp_activation_checkpointing: false") != std::string::npos);
  for (const std::string& line : yaml_lines) CHECK(yaml.find(line) != std::string::npos);
  const std::string lightning = ExportConfig(Plan(c), ExportFormat::kLightning);
  CHECK(lightning.find("activation_checkpointing_policy=None") != std::string::npos);
  CHECK(lightning.find(lightning_line) != std::string::npos);
}

TEST_CASE("selective checkpointing exports HF's attention function under a checkpoint, registered before wrapping") {
  FsdpConfig c;
  c.checkpointing = Checkpointing::kSelective;
  c.attention = Attention::kEager;
  const std::string fsdp1 = ExportConfig(Plan(c, "mistral-7b"), ExportFormat::kFsdp1);
  CHECK(fsdp1.find("from transformers.models.mistral.modeling_mistral import eager_attention_forward as attention_core") != std::string::npos);
  CHECK(fsdp1.find("checkpoint(attention_core, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)") != std::string::npos);
  CHECK(fsdp1.find("AttentionMaskInterface.register(\"fsdpkit_selective\", attention_mask_function)") != std::string::npos);
  CHECK(fsdp1.find("eager_mask as attention_mask_function") != std::string::npos);
  REQUIRE(fsdp1.find("model = FSDP(") != std::string::npos);
  CHECK(fsdp1.find("model.set_attn_implementation(\"fsdpkit_selective\")") < fsdp1.find("model = FSDP("));
  CHECK(fsdp1.find("apply_activation_checkpointing(\n") == std::string::npos);  // not whole blocks
  c.attention = Attention::kFlash;
  c.framework = Framework::kFsdp2;
  const std::string fsdp2 = ExportConfig(Plan(c), ExportFormat::kFsdp2);
  CHECK(fsdp2.find("sdpa_attention_forward as attention_core") != std::string::npos);
  CHECK(fsdp2.find("sdpa_mask as attention_mask_function") != std::string::npos);
  REQUIRE(fsdp2.find("fully_shard(") != std::string::npos);
  CHECK(fsdp2.find("set_attn_implementation") < fsdp2.find("fully_shard("));
  CheckCheckpointingAsComments(c, {"#   AttentionInterface.register(\"fsdpkit_selective\", checkpointed_attention)"},
                               "#   model.set_attn_implementation(\"fsdpkit_selective\")");
}

TEST_CASE("full checkpointing turns the KV cache off") {
  FsdpConfig c;
  c.checkpointing = Checkpointing::kFull;
  const std::string code = ExportConfig(Plan(c), ExportFormat::kFsdp1);
  REQUIRE(code.find("apply_activation_checkpointing(") != std::string::npos);
  CHECK(code.find("model.config.use_cache = False") < code.find("apply_activation_checkpointing("));
}

TEST_CASE("--ac-every 2 exports a check_fn on every second block; accelerate and Lightning carry it as a comment") {
  FsdpConfig c;
  c.checkpointing = Checkpointing::kFull;
  c.ac_every = 2;
  const std::string code = ExportConfig(Plan(c), ExportFormat::kFsdp2);
  CHECK(code.find("if (i + 1) % 2 == 0") != std::string::npos);
  CHECK(code.find("check_fn=lambda m: id(m) in checkpointed_blocks") != std::string::npos);
  CheckCheckpointingAsComments(c, {"#       check_fn=lambda m: id(m) in checkpointed_blocks", "#   import functools"}, "#   apply_activation_checkpointing(");
}

TEST_CASE("--ac selective-op exports torchtitan's op policy as checkpoint_wrapper's context_fn, placed as full checkpointing is") {
  FsdpConfig c;
  c.checkpointing = Checkpointing::kSelectiveOp;
  c.framework = Framework::kFsdp2;
  const std::string fsdp2 = ExportConfig(Plan(c), ExportFormat::kFsdp2);
  CHECK(fsdp2.find("keep = func in op_saved and not (func == torch.ops.aten.mm.default and mm_seen[pass_name] % 2 == 0)") != std::string::npos);
  CHECK(fsdp2.find("torch.ops.aten._scaled_dot_product_flash_attention.default") != std::string::npos);
  CHECK(fsdp2.find("checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=op_selective_context)") != std::string::npos);
  CHECK(fsdp2.find("apply_activation_checkpointing(") < fsdp2.find("fully_shard(module"));  // before sharding
  c.framework = Framework::kFsdp1;
  const std::string fsdp1 = ExportConfig(Plan(c), ExportFormat::kFsdp1);
  CHECK(fsdp1.find("model = FSDP(") < fsdp1.find("apply_activation_checkpointing("));  // after wrapping, as full
  CheckCheckpointingAsComments(c, {"# op-level selective checkpointing is not ", "#   def op_selective_context():"}, "#   def op_selective_context():");
}

TEST_CASE("fp16 exports a ShardedGradScaler; bf16 and fp32 need none") {
  FsdpConfig c;
  c.param_dtype = DType::kFp16;
  for (ExportFormat f : {ExportFormat::kFsdp1, ExportFormat::kFsdp2}) {
    const std::string code = ExportConfig(Plan(c), f);
    CHECK(code.find("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n") != std::string::npos);
    CHECK(code.find("\nscaler = ShardedGradScaler()\n") != std::string::npos);
    CHECK(code.find("scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()") != std::string::npos);
  }
  CHECK(ExportConfig(Plan(c), ExportFormat::kAccelerate).find("mixed_precision: fp16\n") != std::string::npos);
  CHECK(ExportConfig(Plan(c), ExportFormat::kLightning).find("precision=\"16-mixed\"") != std::string::npos);
  for (DType d : {DType::kBf16, DType::kFp32}) {
    c.param_dtype = d;
    c.reduce_dtype = DType::kFp32;
    for (ExportFormat f : {ExportFormat::kFsdp1, ExportFormat::kFsdp2, ExportFormat::kAccelerate, ExportFormat::kLightning}) {
      CHECK(ExportConfig(Plan(c), f).find("ShardedGradScaler") == std::string::npos);
    }
  }
}

TEST_CASE("accelerate YAML uses the keys and values accelerate reads") {
  Json keys = Keys();
  for (Framework fw : {Framework::kFsdp1, Framework::kFsdp2}) {
    FsdpConfig c;
    c.framework = fw;
    c.cpu_offload = true;
    c.wrap = WrapPolicy::kSize;
    c.wrap_min_params = 100000000;
    const std::string yaml = ExportConfig(Plan(c, "qwen2.5-7b"), ExportFormat::kAccelerate);
    std::set<std::string> top, fsdp;
    std::regex top_key("^([a-z_0-9]+):"), fsdp_key("^  ([a-z_0-9]+): (.*)$");
    std::smatch m;
    std::istringstream in(yaml);
    Json values = keys["accelerate_fsdp_values"];
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with("#")) continue;
      if (std::regex_search(line, m, top_key)) top.insert(m[1]);
      if (std::regex_match(line, m, fsdp_key)) {
        fsdp.insert(m[1]);
        if (values.contains(m[1].str())) {
          CAPTURE(line);
          CHECK(Set(values[m[1].str()]).count(m[2].str()) == 1);
        }
      }
    }
    CheckSubset(top, Set(keys["accelerate_top_level_keys"]), "accelerate top level");
    CheckSubset(fsdp, Set(keys["accelerate_fsdp_config_keys"]), "fsdp_config");
    CHECK(top.count("distributed_type") == 1);
    CHECK(yaml.find("distributed_type: FSDP") != std::string::npos);
    CHECK(fsdp.count("fsdp_offload_params") == 1);
    CHECK(fsdp.count("fsdp_min_num_params") == 1);
  }
}

TEST_CASE("Lightning export uses FSDPStrategy's arguments (the rest pass through to FSDP)") {
  Json keys = Keys();
  FsdpConfig c;
  c.checkpointing = Checkpointing::kFull;
  const std::string code = ExportConfig(Plan(c, "gpt2-xl"), ExportFormat::kLightning);
  std::set<std::string> allowed = Set(keys["lightning_fsdp_strategy_args"]);
  for (const auto& k : Set(keys["fsdp1_constructor_args"])) allowed.insert(k);  // **kwargs
  CheckSubset(Kwargs(code, "FSDPStrategy"), allowed, "FSDPStrategy");
  CHECK(code.find("sharding_strategy=\"FULL_SHARD\"") != std::string::npos);
  CHECK(code.find("activation_checkpointing_policy={GPT2Block}") != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(code, m, std::regex("precision=\"([^\"]+)\"")));
  CHECK(Set(keys["lightning_trainer_precision_values"]).count(m[1].str()) == 1);
}

TEST_CASE("LoRA and QLoRA exports: peft's and transformers' own argument names, peft's wrap policy imported and used") {
  Json keys = Keys();
  FsdpConfig c;
  c.wrap = WrapPolicy::kPeft;
  c.lora.rank = 16;
  c.lora.targets = "q_proj,down_proj";
  c.lora.qlora = true;
  c.lora.double_quant = true;
  const Workload w = Plan(c);
  for (ExportFormat f : {ExportFormat::kFsdp1, ExportFormat::kLightning}) {
    const std::string code = ExportConfig(w, f);
    CAPTURE(code);
    CheckSubset(Kwargs(code, "LoraConfig"), Set(keys["peft_lora_config_args"]), "LoraConfig");
    CheckSubset(Kwargs(code, "get_peft_model"), Set(keys["peft_get_peft_model_args"]), "get_peft_model");
    CheckSubset(Kwargs(code, "BitsAndBytesConfig"), Set(keys["transformers_bnb_config_args"]), "BitsAndBytesConfig");
    CHECK(code.find("target_modules=[\"self_attn.q_proj\", \"mlp.down_proj\"]") != std::string::npos);
    CHECK(code.find("bnb_4bit_use_double_quant=True") != std::string::npos);
    CHECK(code.find("from peft.utils.other import fsdp_auto_wrap_policy") < code.find("auto_wrap_policy=fsdp_auto_wrap_policy(model),"));
  }
  // accelerate: the decoder layers, which transformers' Trainer turns into peft's policy; the model code as a comment
  const std::string yaml = ExportConfig(w, ExportFormat::kAccelerate);
  CHECK(yaml.find("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP") != std::string::npos);
  CHECK(yaml.find("#   model = get_peft_model(") != std::string::npos);
  // pure bf16 keeps the adapters in bf16: peft's upcast off
  c.lora.qlora = c.lora.double_quant = false;
  c.master_dtype = DType::kBf16;
  CHECK(ExportConfig(Plan(c), ExportFormat::kFsdp1).find("autocast_adapter_dtype=False") != std::string::npos);
}

TEST_CASE("unknown export formats are rejected") {
  CHECK_FALSE(ParseExportFormat("deepspeed").ok());
  CHECK(ParseExportFormat("pytorch").value() == ExportFormat::kFsdp1);
}

}  // namespace
}  // namespace fsdp
