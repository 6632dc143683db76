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
      {"llama", ReadLlama}, {"mistral", ReadMistral}, {"mixtral", ReadMixtral}, {"qwen2", ReadQwen2}, {"qwen3", ReadQwen3}, {"qwen3_moe", ReadQwen3Moe},
      {"gemma2", ReadGemma2}, {"gemma3_text", ReadGemma3Text}, {"gemma3", ReadGemma3},
      {"olmo2", ReadOlmo2}, {"phi3", ReadPhi3}, {"deepseek_v3", ReadDeepseekV3}, {"gpt_oss", ReadGptOss}, {"llama4_text", ReadLlama4Text}, {"llama4", ReadLlama4}, {"gpt2", ReadGpt2},
  };
  return kFamilies;
}

}  // namespace fsdp::families
