// The family table: one entry per HF model_type fsdpkit loads (family.h).
#include "core/families/family.h"

namespace fsdp::families {

Status ReadLlama(const JsonReader& r, ModelSpec& m);
Status ReadMistral(const JsonReader& r, ModelSpec& m);
Status ReadMixtral(const JsonReader& r, ModelSpec& m);
Status ReadQwen2(const JsonReader& r, ModelSpec& m);
Status ReadQwen3(const JsonReader& r, ModelSpec& m);
Status ReadQwen3Moe(const JsonReader& r, ModelSpec& m);
Status ReadPhi3(const JsonReader& r, ModelSpec& m);
Status ReadGemma2(const JsonReader& r, ModelSpec& m);
Status ReadGemma3Text(const JsonReader& r, ModelSpec& m);
Status ReadGemma3(const JsonReader& r, ModelSpec& m);
Status ReadOlmo2(const JsonReader& r, ModelSpec& m);
Status ReadDeepseekV3(const JsonReader& r, ModelSpec& m);
Status ReadGptOss(const JsonReader& r, ModelSpec& m);
Status ReadLlama4Text(const JsonReader& r, ModelSpec& m);
Status ReadLlama4(const JsonReader& r, ModelSpec& m);
Status ReadGpt2(const JsonReader& r, ModelSpec& m);

const std::vector<Family>& Families() {
  static const std::vector<Family> kFamilies = {
      {"llama", ReadLlama, {4, 31}, {4, 46}, {4, 40}, {4, 38}},  {"mistral", ReadMistral, {4, 34}, {4, 48}, {4, 41}},
      {"mixtral", ReadMixtral, {4, 36}, {4, 46}, {4, 47}},  {"qwen2", ReadQwen2, {4, 37}, {4, 46}, {4, 44}},          {"qwen3", ReadQwen3, {4, 51}},         {"qwen3_moe", ReadQwen3Moe, {4, 51}},
      {"gemma2", ReadGemma2, {4, 42}},        {"gemma3_text", ReadGemma3Text, {4, 50}}, {"gemma3", ReadGemma3, {4, 50}},
      {"olmo2", ReadOlmo2, {4, 47}},          {"phi3", ReadPhi3, {4, 41}},           {"deepseek_v3", ReadDeepseekV3, {4, 51}},
      {"gpt_oss", ReadGptOss, {4, 55}},       {"llama4_text", ReadLlama4Text, {4, 51}}, {"llama4", ReadLlama4, {4, 51}},
      {"gpt2", ReadGpt2, {4, 48}, {4, 48}},
  };
  return kFamilies;
}

const Family* FindFamily(std::string_view model_type) {
  for (const Family& f : Families()) {
    if (f.model_type == model_type) return &f;
  }
  return nullptr;
}

}  // namespace fsdp::families
