#include "runtime/safetensors.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/catalog.h"
#include "core/lora.h"
#include "core/workload.h"
#include "runtime/fsdp_engine.h"
#include "runtime/nf4.h"

namespace fsdp::runtime {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with the object.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) : path(fs::temp_directory_path() / ("fsdpkit-safetensors-" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& file) const { return (path / file).string(); }
};

// Writes the format by hand: 8-byte little-endian header length, header, data.
void WriteFile(const std::string& path, const std::string& header, const std::vector<unsigned char>& data, uint64_t claimed_length = 0) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = claimed_length ? claimed_length : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

void Append(std::vector<unsigned char>& data, const void* p, size_t n) {
  const size_t at = data.size();
  data.resize(at + n);
  std::memcpy(data.data() + at, p, n);
}

// F32 [2, 2] {1, -2, 0.5, 3e38}, BF16 [2] {1.5, -0.25}, F16 [4] {1, 65504, 2^-24, -inf}, I32 [1].
std::vector<unsigned char> MixedData() {
  std::vector<unsigned char> d;
  const float f32[4] = {1.0f, -2.0f, 0.5f, 3e38f};
  Append(d, f32, 16);
  const uint16_t bf16[2] = {0x3FC0, 0xBE80};
  Append(d, bf16, 4);
  const uint16_t f16[4] = {0x3C00, 0x7BFF, 0x0001, 0xFC00};
  Append(d, f16, 8);
  const int32_t i32 = 7;
  Append(d, &i32, 4);
  return d;
}

const char* kMixedHeader =
    R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
    R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]},"c":{"dtype":"F16","shape":[4],"data_offsets":[20,28]},)"
    R"("n":{"dtype":"I32","shape":[1],"data_offsets":[28,32]}})";

TEST_CASE("safetensors tensors read back as fp32 from F32, BF16 and F16") {
  TempDir dir("read");
  WriteFile(dir / "model.safetensors", kMixedHeader, MixedData());
  auto c = Checkpoint::Open(dir.path.string());  // a directory with model.safetensors
  REQUIRE(c.ok());
  CHECK(c.value().size() == 4);  // __metadata__ is not a tensor
  const uint64_t fingerprint = c.value().Fingerprint();
  WriteFile(dir / "model.safetensors", kMixedHeader, MixedData());  // the same file again: the same fingerprint
  CHECK(Checkpoint::Open(dir.path.string()).value().Fingerprint() == fingerprint);
  WriteFile(dir / "other.safetensors", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::vector<unsigned char>(16, 0));
  CHECK(Checkpoint::Open(dir / "other.safetensors").value().Fingerprint() != fingerprint);
  float a[4], b[2], h[4];
  REQUIRE(c.value().Read("a", {2, 2}, a).ok());
  CHECK(a[0] == 1.0f);
  CHECK(a[1] == -2.0f);
  CHECK(a[3] == 3e38f);
  REQUIRE(c.value().Read("b", {2}, b).ok());
  CHECK(b[0] == 1.5f);
  CHECK(b[1] == -0.25f);
  // a non-finite weight is refused, naming the tensor and element (a NaN checkpoint once trained to nan, exit 0)
  auto infinite = c.value().Read("c", {4}, h);
  REQUIRE_FALSE(infinite.ok());
  CHECK(infinite.error().message == dir / "model.safetensors" + ": tensor 'c' holds -inf at element 3: a checkpoint to train from must be finite");
  CHECK(h[0] == 1.0f);
  CHECK(h[1] == 65504.0f);              // largest finite half
  CHECK(h[2] == std::ldexp(1.0f, -24));  // smallest subnormal half

  auto absent = c.value().Check("lm_head.weight", {2});
  REQUIRE_FALSE(absent.ok());
  CHECK(absent.error().message == "checkpoint '" + dir.path.string() + "' has no tensor 'lm_head.weight'");
  auto shape = c.value().Read("a", {4}, a);
  REQUIRE_FALSE(shape.ok());
  CHECK(shape.error().message == dir / "model.safetensors" + ": tensor 'a' has shape [2, 2], the model's config needs [4]");
  auto dtype = c.value().Check("n", {1});
  REQUIRE_FALSE(dtype.ok());
  CHECK(dtype.error().message == dir / "model.safetensors" + ": tensor 'n' is I32; fsdp-run reads F32, BF16 and F16");
}

TEST_CASE("a sharded checkpoint is found through its index") {
  TempDir dir("sharded");
  std::vector<unsigned char> one(8, 0), two;
  const float x[2] = {4.0f, 5.0f};
  Append(two, x, 8);
  WriteFile(dir / "model-00001-of-00002.safetensors", R"({"p":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", one);
  WriteFile(dir / "model-00002-of-00002.safetensors", R"({"q":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})", two);
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"p":"model-00001-of-00002.safetensors","q":"model-00002-of-00002.safetensors"}})";
  auto c = Checkpoint::Open(dir.path.string());
  REQUIRE(c.ok());
  CHECK(c.value().size() == 2);
  float q[2];
  REQUIRE(c.value().Read("q", {1, 2}, q).ok());
  CHECK(q[1] == 5.0f);

  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map":{"p":"missing.safetensors"}})";
  auto missing = Checkpoint::Open(dir.path.string());
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().message == "checkpoint file '" + dir / "missing.safetensors" + "' cannot be read");
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map":{"p":"../x.safetensors"}})";
  CHECK(Checkpoint::Open(dir.path.string()).error().message ==
        dir / "model.safetensors.index.json" + ": weight_map entry 'p' must name a file in the directory");
  fs::remove(dir / "model.safetensors.index.json");
  CHECK(Checkpoint::Open(dir.path.string()).error().message ==
        "checkpoint directory '" + dir.path.string() + "' has neither model.safetensors nor model.safetensors.index.json");
  std::ofstream(dir / "pytorch_model.bin") << "pickle";
  CHECK(Checkpoint::Open(dir.path.string()).error().message ==
        "checkpoint directory '" + dir.path.string() +
            "' has neither model.safetensors nor model.safetensors.index.json (pytorch_model.bin is not read: save it again with "
            "transformers' save_pretrained)");
}

TEST_CASE("malformed safetensors files are refused with the file and the reason") {
  TempDir dir("bad");
  const std::string f = dir / "m.safetensors";
  auto error = [&] {
    auto c = Checkpoint::Open(f);
    REQUIRE_FALSE(c.ok());
    return c.error().message;
  };
  CHECK(Checkpoint::Open(dir / "none.safetensors").error().message == "checkpoint '" + dir / "none.safetensors" + "' does not exist");
  std::ofstream(f) << "abc";
  CHECK(error() == f + ": not a safetensors file (shorter than its 8-byte header length)");
  WriteFile(f, "{}", {}, 1'000'000);
  CHECK(error() == f + ": not a safetensors file (header length 1000000 in a 10-byte file)");
  WriteFile(f, "{\"a\":", {});
  const std::string syntax = error();
  CHECK(syntax.starts_with(f + ":1:"));
  CHECK(syntax.find(": malformed JSON") != std::string::npos);
  WriteFile(f, "[1]", {});
  CHECK(error() == f + ": the header is not a JSON object");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", std::vector<unsigned char>(8, 0));
  CHECK(error() == f + ": tensor 'a': data_offsets [0, 16] outside the 8 bytes of data");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::vector<unsigned char>(8, 0));
  CHECK(error() == f + ": tensor 'a': 8 bytes for a F32 [3] tensor of 12 bytes");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", {});
  CHECK(error() == f + ": tensor 'a': shape entries must be non-negative integers");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[2]}})", {});
  CHECK(error() == f + R"(: tensor 'a': expected {"dtype": string, "shape": [...], "data_offsets": [begin, end]})");
}

TEST_CASE("more edge cases: truncated data, float offsets, a bad weight_map, a huge shape") {
  TempDir dir("edges");
  const std::string f = dir / "m.safetensors";
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::vector<unsigned char>(8, 0));
  auto c = Checkpoint::Open(f);
  REQUIRE(c.ok());
  fs::resize_file(f, fs::file_size(f) - 4);  // cut after Open read the header
  float a[2];
  auto truncated = c.value().Read("a", {2}, a);
  REQUIRE_FALSE(truncated.ok());
  CHECK(truncated.error().message == f + ": tensor 'a' cannot be read");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8.0]}})", std::vector<unsigned char>(8, 0));
  CHECK(Checkpoint::Open(f).error().message == f + ": tensor 'a': data_offsets must be non-negative integers");
  WriteFile(f, R"({"a":{"dtype":"F32","shape":[1099511627776,16777216],"data_offsets":[0,0]}})", {});  // 2^40 x 2^24
  CHECK(Checkpoint::Open(f).error().message == f + ": tensor 'a': more than 2^40 elements");
  fs::remove(f);
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map":["a"]})";
  CHECK(Checkpoint::Open(dir.path.string()).error().message ==
        dir / "model.safetensors.index.json" + ": expected an object with a 'weight_map' object");
}

// Every tensor of tiny-llama as (tensor index + 1) + (element % 1024) / 1024, exact in fp32.
float Marker(int tensor, int64_t element) { return static_cast<float>(tensor + 1) + static_cast<float>(element % 1024) / 1024.0f; }

void WriteModel(const std::string& path, const ModelSpec& m, const std::string& skip = "") {
  std::string header = "{";
  std::vector<unsigned char> data;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorSpec& ts = m.tensors[t];
    if (ts.name == skip) continue;
    std::string shape;
    for (int64_t d : ts.shape) {
      if (!shape.empty()) shape += ',';
      shape += std::to_string(d);
    }
    header += fmt::format(R"({}"{}":{{"dtype":"F32","shape":[{}],"data_offsets":[{},{}]}})", header.size() > 1 ? "," : "", ts.name, shape,
                          data.size(), data.size() + ts.numel() * 4);
    for (int64_t i = 0; i < ts.numel(); ++i) {
      const float v = Marker(static_cast<int>(t), i);
      Append(data, &v, 4);
    }
  }
  WriteFile(path, header + "}", data);
}

TEST_CASE("StartingUnit places every checkpoint tensor at its offset in each unit, padding zero") {
  TempDir dir("model");
  const ModelSpec model = LoadModel("tiny-llama").value();
  WriteModel(dir / "model.safetensors", model);
  TrainOptions options;
  options.checkpoint = std::make_shared<const Checkpoint>(Checkpoint::Open(dir.path.string()).value());
  for (WrapPolicy wrap : {WrapPolicy::kBlock, WrapPolicy::kNone}) {
    FsdpConfig config;
    config.gpus = config.gpus_per_node = 3;  // padding to a multiple of 3
    config.wrap = wrap;
    config.seq_len = 16;
    const Workload w = BuildWorkload(model, LoadHardware("h100-sxm").value(), config).value();
    int64_t checked = 0;
    for (size_t u = 0; u < w.units.size(); ++u) {
      auto flat = StartingUnit(w, LayoutOf(w), static_cast<int>(u), options);
      REQUIRE(flat.ok());
      REQUIRE(static_cast<int64_t>(flat.value().size()) == w.units[u].padded_numel);
      int64_t offset = 0;
      for (int t : w.units[u].tensors) {
        for (int64_t i = 0; i < model.tensors[t].numel(); ++i) {
          if (flat.value()[static_cast<size_t>(offset + i)] != Marker(t, i)) FAIL("tensor ", model.tensors[t].name, " element ", i);
        }
        offset += model.tensors[t].numel();
      }
      for (int64_t i = offset; i < w.units[u].padded_numel; ++i) CHECK(flat.value()[static_cast<size_t>(i)] == 0.0f);
      checked += offset;
    }
    CHECK(checked == model.ParamsTotal());  // every tensor, once
  }
  WriteModel(dir / "model.safetensors", model, "model.norm.weight");
  options.checkpoint = std::make_shared<const Checkpoint>(Checkpoint::Open(dir.path.string()).value());
  FsdpConfig config;
  config.gpus = config.gpus_per_node = 1;
  const Workload w = BuildWorkload(model, LoadHardware("h100-sxm").value(), config).value();
  auto missing = StartingUnit(w, LayoutOf(w), 0, options);  // the root unit holds the final norm
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().message == "checkpoint '" + dir.path.string() + "' has no tensor 'model.norm.weight'");
}

// tiny-llama's checkpoint in a temporary directory, options that start from it, and LoRA r=4 under
// FSDP2 on 2 ranks (peft's default targets for llama: q_proj, v_proj)
struct TinyLoraCheckpoint {
  TinyLoraCheckpoint() {
    WriteModel(dir / "model.safetensors", base);
    options.checkpoint = std::make_shared<const Checkpoint>(Checkpoint::Open(dir.path.string()).value());
    config.gpus = config.gpus_per_node = 2;
    config.framework = Framework::kFsdp2;
    config.seq_len = 16;
    config.lora.rank = 4;
  }
  TempDir dir{"model"};
  ModelSpec base = LoadModel("tiny-llama").value();
  TrainOptions options;
  FsdpConfig config;
};

// A base model's checkpoint under LoRA (FSDP2, 2 ranks): each wrapped weight read from its HF name,
// the frozen group first in each block's buffer, then the adapters as peft initialises them.
TEST_CASE("StartingUnit under LoRA: base weights by their HF names, the frozen group first, adapters as peft starts them") {
  TinyLoraCheckpoint fixture;
  const ModelSpec& base = fixture.base;
  const TrainOptions& options = fixture.options;
  FsdpConfig& config = fixture.config;
  ModelSpec model = base;
  REQUIRE(ApplyLora(model, config.lora).ok());
  const Workload w = BuildWorkload(model, LoadHardware("h100-sxm").value(), config).value();
  const EngineLayout layout = LayoutOf(w);
  const WrapUnit& block = w.units[1];
  REQUIRE(block.name == "model.layers.0");
  // tiny-llama: hidden 128, 2 kv heads of 32: q A (4, 128) B (128, 4), v A (4, 128) B (64, 4)
  CHECK(block.grad_padded_numel == 512 + 512 + 512 + 256);  // the adapters only (dim 0 already a multiple of 2)
  CHECK(layout.frozen_padded[1] == block.padded_numel - block.grad_padded_numel);
  auto flat = StartingUnit(w, layout, 1, options);
  REQUIRE(flat.ok());
  for (int t : block.tensors) {
    const TensorSpec& ts = model.tensors[t];
    const float* v = flat.value().data() + layout.offset[t];
    CAPTURE(ts.name);
    CHECK(layout.Trained(w, t) == ts.trainable);
    CHECK((layout.offset[t] >= layout.frozen_padded[1]) == ts.trainable);
    if (ts.name.ends_with("lora_B.default.weight")) {
      CHECK(std::all_of(v, v + ts.numel(), [](float x) { return x == 0.0f; }));
    } else if (ts.name.ends_with("lora_A.default.weight")) {  // U(-1/sqrt(128), 1/sqrt(128)), not all zero
      CHECK(std::all_of(v, v + ts.numel(), [](float x) { return std::abs(x) <= 1.0f / std::sqrt(128.0f); }));
      CHECK(std::any_of(v, v + ts.numel(), [](float x) { return x != 0.0f; }));
    } else {  // the base checkpoint's tensor of the name without ".base_layer"
      std::string name = ts.name;
      if (const size_t at = name.find(".base_layer"); at != std::string::npos) name.erase(at, 11);
      const auto it = std::find_if(base.tensors.begin(), base.tensors.end(), [&](const TensorSpec& b) { return b.name == name; });
      REQUIRE(it != base.tensors.end());
      const int source = static_cast<int>(it - base.tensors.begin());
      for (int64_t i = 0; i < ts.numel(); ++i) {
        if (v[i] != Marker(source, i)) FAIL("element ", i);
      }
    }
  }
}

TEST_CASE("StartingUnit under QLoRA: each block linear quantized from its checkpoint values rounded to bf16, packed in bf16 elements, absmax kept") {
  TinyLoraCheckpoint fixture;
  const ModelSpec& base = fixture.base;
  const TrainOptions& options = fixture.options;
  FsdpConfig& config = fixture.config;
  config.param_dtype = DType::kBf16;
  config.lora.qlora = true;
  ModelSpec model = base;
  REQUIRE(ApplyLora(model, config.lora, config.param_dtype).ok());
  const Workload w = BuildWorkload(model, LoadHardware("h100-sxm").value(), config).value();
  const EngineLayout layout = LayoutOf(w);
  std::vector<Nf4QuantState> state(model.tensors.size());
  auto flat = StartingUnit(w, layout, 1, options, &state);
  REQUIRE(flat.ok());
  int quantized = 0;
  for (int t : w.units[1].tensors) {
    const TensorSpec& ts = model.tensors[t];
    if (ts.nf4_numel == 0) continue;
    CAPTURE(ts.name);
    ++quantized;
    std::string name = ts.name;  // the checkpoint's tensor, without peft's ".base_layer"
    if (const size_t at = name.find(".base_layer"); at != std::string::npos) name.erase(at, 11);
    const auto source = static_cast<int>(std::find_if(base.tensors.begin(), base.tensors.end(), [&](const TensorSpec& b) { return b.name == name; }) -
                                         base.tensors.begin());
    std::vector<float> values(static_cast<size_t>(ts.nf4_numel));
    for (int64_t i = 0; i < ts.nf4_numel; ++i) values[static_cast<size_t>(i)] = RoundTo(Marker(source, i), DType::kBf16);
    const Nf4Weight expected = Nf4Quantize(values.data(), ts.nf4_numel);
    CHECK(state[static_cast<size_t>(t)].absmax == expected.absmax);
    CHECK(state[static_cast<size_t>(t)].absmax_q.empty());  // not double-quantized
    CHECK(static_cast<int64_t>(state[static_cast<size_t>(t)].absmax.size()) == (ts.nf4_numel + 63) / 64);
    const float* v = flat.value().data() + layout.offset[t];
    CHECK(Nf4PackedBytes(v, ts.numel(), DType::kBf16) == expected.packed);  // ts.numel() bf16 elements: 4 codes each
    CHECK(ts.numel() * 4 == ts.nf4_numel);
  }
  CHECK(quantized == 7);  // q, k, v, o, gate, up, down
}

TEST_CASE("CheckpointTensorName finds an adapter under peft's saved name, and none where the checkpoint lacks it") {
  TempDir dir("model");
  ModelSpec model = LoadModel("tiny-llama").value();
  LoraConfig lora;
  lora.rank = 2;
  REQUIRE(ApplyLora(model, lora).ok());
  ModelSpec saved = model;  // peft's save_pretrained keys: base_model.model.<module>.lora_A.weight
  for (TensorSpec& t : saved.tensors) {
    if (const size_t at = t.name.find(".default."); at != std::string::npos) t.name = "base_model.model." + t.name.erase(at, 8);
  }
  WriteModel(dir / "model.safetensors", saved);
  const Checkpoint checkpoint = Checkpoint::Open(dir.path.string()).value();
  const TensorSpec& a = *std::find_if(model.tensors.begin(), model.tensors.end(), [](const TensorSpec& t) { return t.name.ends_with("lora_A.default.weight"); });
  CHECK(CheckpointTensorName(checkpoint, a) == "base_model.model." + a.name.substr(0, a.name.size() - 14) + "weight");
  const TensorSpec& base = *std::find_if(model.tensors.begin(), model.tensors.end(), [](const TensorSpec& t) { return t.name.ends_with("base_layer.weight"); });
  CHECK(CheckpointTensorName(checkpoint, base) == base.name);  // written under its own (wrapped) name
  WriteModel(dir / "model.safetensors", LoadModel("tiny-llama").value());  // the base model alone
  CHECK(CheckpointTensorName(Checkpoint::Open(dir.path.string()).value(), a).empty());
}

// Qwen3-MoE as save_pretrained writes it: the Hub's per-expert tensors in place of transformers 5's
// fused mlp.experts.gate_up_proj [E, 2I, h] and mlp.experts.down_proj [E, h, I].
TEST_CASE("fused experts start from the Hub's per-expert tensors: per expert, gate's rows then up's") {
  TempDir dir("model");
  auto json = ParseJson(R"({"model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 8, "moe_intermediate_size": 4, "num_experts": 3,
                            "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 1})",
                        "moe.json");
  REQUIRE(json.ok());
  const ModelSpec model = ModelFromHfConfig(json.value(), "moe", "moe.json").value();
  const int64_t experts = 3, inner = 4, hidden = 8;
  ModelSpec hub = model;
  hub.tensors.clear();
  for (const TensorSpec& t : model.tensors) {
    const bool gate_up = t.name.ends_with(".gate_up_proj"), down = t.name.ends_with(".down_proj") && t.shape.size() == 3;
    if (!gate_up && !down) {
      hub.tensors.push_back(t);
      continue;
    }
    const std::string prefix = t.name.substr(0, t.name.rfind('.') + 1);
    for (int64_t e = 0; e < experts; ++e) {
      TensorSpec piece = t;
      piece.shape = gate_up ? std::vector<int64_t>{inner, hidden} : std::vector<int64_t>{hidden, inner};
      for (const char* part : gate_up ? std::vector<const char*>{"gate_proj", "up_proj"} : std::vector<const char*>{"down_proj"}) {
        piece.name = fmt::format("{}{}.{}.weight", prefix, e, part);
        hub.tensors.push_back(piece);
      }
    }
  }
  WriteModel(dir / "model.safetensors", hub);
  TrainOptions options;
  options.checkpoint = std::make_shared<const Checkpoint>(Checkpoint::Open(dir.path.string()).value());
  auto index_in_hub = [&](const std::string& name) {
    return static_cast<int>(std::find_if(hub.tensors.begin(), hub.tensors.end(), [&](const TensorSpec& t) { return t.name == name; }) - hub.tensors.begin());
  };
  const int fused = static_cast<int>(std::find_if(model.tensors.begin(), model.tensors.end(), [](const TensorSpec& t) { return t.name.ends_with(".gate_up_proj"); }) -
                                     model.tensors.begin());
  const std::vector<CheckpointPiece> pieces = CheckpointPieces(*options.checkpoint, model.tensors[static_cast<size_t>(fused)]);
  REQUIRE(pieces.size() == 6);
  CHECK(pieces[0].name == "model.layers.0.mlp.experts.0.gate_proj.weight");
  CHECK(pieces[1].name == "model.layers.0.mlp.experts.0.up_proj.weight");
  CHECK(pieces[5].name == "model.layers.0.mlp.experts.2.up_proj.weight");
  CHECK(pieces[5].shape == std::vector<int64_t>{inner, hidden});
  FsdpConfig config;
  config.gpus = 1;
  config.wrap = WrapPolicy::kNone;
  config.seq_len = 4;
  const Workload w = BuildWorkload(model, LoadHardware("h100-sxm").value(), config).value();
  const EngineLayout layout = LayoutOf(w);
  auto flat = StartingUnit(w, layout, 0, options);
  REQUIRE(flat.ok());
  for (int64_t e = 0; e < experts; ++e) {  // element (e, r, c) of gate_up_proj: gate_e's (r, c), then up_e's (r - I, c)
    for (int64_t r = 0; r < 2 * inner; ++r) {
      const int source = index_in_hub(fmt::format("model.layers.0.mlp.experts.{}.{}.weight", e, r < inner ? "gate_proj" : "up_proj"));
      for (int64_t c = 0; c < hidden; ++c) {
        const float got = flat.value()[static_cast<size_t>(layout.offset[fused] + (e * 2 * inner + r) * hidden + c)];
        if (got != Marker(source, (r % inner) * hidden + c)) FAIL("expert ", e, " row ", r, " column ", c);
      }
    }
  }
}

}  // namespace
}  // namespace fsdp::runtime
