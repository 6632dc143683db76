#include "runtime/safetensors.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

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
  const auto* b = static_cast<const unsigned char*>(p);
  data.insert(data.end(), b, b + n);
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
  float a[4], b[2], h[4];
  REQUIRE(c.value().Read("a", {2, 2}, a).ok());
  CHECK(a[0] == 1.0f);
  CHECK(a[1] == -2.0f);
  CHECK(a[3] == 3e38f);
  REQUIRE(c.value().Read("b", {2}, b).ok());
  CHECK(b[0] == 1.5f);
  CHECK(b[1] == -0.25f);
  REQUIRE(c.value().Read("c", {4}, h).ok());
  CHECK(h[0] == 1.0f);
  CHECK(h[1] == 65504.0f);              // largest finite half
  CHECK(h[2] == std::ldexp(1.0f, -24));  // smallest subnormal half
  CHECK(h[3] == -std::numeric_limits<float>::infinity());

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

}  // namespace
}  // namespace fsdp::runtime
