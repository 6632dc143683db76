#include "runtime/safetensors.h"

#include <cstring>
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "core/hash.h"
#include "core/json_io.h"

namespace fsdp::runtime {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the format's own limit (safetensors README)
// Tensor bytes are little-endian in the file and copied as they are.
static_assert(std::endian::native == std::endian::little, "safetensors reading assumes a little-endian host");

// Bytes per element of the safetensors dtypes; 0 for names the format does not define.
int64_t ElementBytes(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {{"F64", 8}, {"I64", 8}, {"U64", 8}, {"F32", 4}, {"I32", 4}, {"U32", 4},
                                                       {"F16", 2}, {"BF16", 2}, {"I16", 2}, {"U16", 2}, {"I8", 1}, {"U8", 1},
                                                       {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE binary16 to binary32, subnormals, infinities and NaN included.
float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// One header entry: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]} relative to the
// data section of `data_bytes` bytes.
Status ParseEntry(const std::string& file, const std::string& name, const Json& j, int64_t data_start, int64_t data_bytes, std::string& dtype,
                  std::vector<int64_t>& shape, int64_t& offset, int64_t& bytes) {
  auto bad = [&](const std::string& what) {
    const std::string shown = name.size() > 80 ? name.substr(0, 80) + "..." : name;
    return Error::BadInput(fmt::format("{}: tensor '{}': {}", file, shown, what));
  };
  if (!j.is_object() || !j.contains("dtype") || !j["dtype"].is_string() || !j.contains("shape") || !j["shape"].is_array() ||
      !j.contains("data_offsets") || !j["data_offsets"].is_array() || j["data_offsets"].size() != 2) {
    return bad("expected {\"dtype\": string, \"shape\": [...], \"data_offsets\": [begin, end]}");
  }
  dtype = j["dtype"].get<std::string>();
  constexpr int64_t kMaxNumel = int64_t{1} << 40;
  int64_t numel = 1;
  for (const Json& d : j["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad("shape entries must be non-negative integers");
    const int64_t dim = d.get<int64_t>();
    if (dim > 0 && numel > kMaxNumel / dim) return bad("more than 2^40 elements");  // checked before it could overflow
    shape.push_back(dim);
    numel *= dim;
  }
  const Json& o = j["data_offsets"];
  if (!o[0].is_number_unsigned() || !o[1].is_number_unsigned()) return bad("data_offsets must be non-negative integers");
  const uint64_t begin = o[0].get<uint64_t>(), end = o[1].get<uint64_t>();
  if (begin > end || end > static_cast<uint64_t>(data_bytes)) {
    return bad(fmt::format("data_offsets [{}, {}] outside the {} bytes of data", begin, end, data_bytes));
  }
  const int64_t element = ElementBytes(dtype);
  if (element > 0 && static_cast<int64_t>(end - begin) != numel * element) {
    return bad(fmt::format("{} bytes for a {} {} tensor of {} bytes", end - begin, dtype, ShapeText(shape), numel * element));
  }
  offset = data_start + static_cast<int64_t>(begin);
  bytes = static_cast<int64_t>(end - begin);
  return {};
}

}  // namespace

namespace {

uint64_t HeaderLength(std::string_view head) {
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<unsigned char>(head[i]);  // little-endian
  return header_bytes;
}

}  // namespace

Status Checkpoint::AddFile(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return Error::BadInput(fmt::format("checkpoint file '{}' cannot be read", file));
  std::error_code ec;
  const auto file_bytes = static_cast<uint64_t>(std::filesystem::file_size(file, ec));
  if (ec) return Error::BadInput(fmt::format("checkpoint file '{}' cannot be read: {}", file, ec.message()));
  std::string head(8, '\0');
  if (file_bytes < 8 || !in.read(head.data(), 8)) {
    return Error::BadInput(fmt::format("{}: not a safetensors file (shorter than its 8-byte header length)", file));
  }
  const uint64_t header_bytes = HeaderLength(head);
  if (header_bytes <= kMaxHeaderBytes && header_bytes <= file_bytes - 8) {
    head.resize(8 + header_bytes);
    if (!in.read(head.data() + 8, static_cast<std::streamsize>(header_bytes))) return Error::BadInput(fmt::format("{}: truncated header", file));
  }
  return AddHead(file, head, file_bytes);
}

Result<Checkpoint> Checkpoint::FromHead(const std::string& file, std::string_view head, uint64_t file_bytes) {
  Checkpoint c;
  c.origin_ = file;
  if (Status s = c.AddHead(file, head, file_bytes); !s.ok()) return s.error();
  return c;
}

Status Checkpoint::AddHead(const std::string& file, std::string_view head, uint64_t file_bytes) {
  if (file_bytes < 8 || head.size() < 8) {
    return Error::BadInput(fmt::format("{}: not a safetensors file (shorter than its 8-byte header length)", file));
  }
  const uint64_t header_bytes = HeaderLength(head);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    return Error::BadInput(fmt::format("{}: not a safetensors file (header length {} in a {}-byte file)", file, header_bytes, file_bytes));
  }
  if (head.size() < 8 + header_bytes) return Error::BadInput(fmt::format("{}: truncated header", file));
  auto json = ParseJson(std::string(head.substr(8, header_bytes)), file);
  if (!json.ok()) return json.error();
  if (!json.value().is_object()) return Error::BadInput(fmt::format("{}: the header is not a JSON object", file));
  const auto data_start = static_cast<int64_t>(8 + header_bytes);
  const auto data_bytes = static_cast<int64_t>(file_bytes) - data_start;
  for (const auto& [name, value] : json.value().items()) {
    if (name == "__metadata__") continue;
    Entry e;
    e.file = file;
    if (Status s = ParseEntry(file, name, value, data_start, data_bytes, e.dtype, e.shape, e.offset, e.bytes); !s.ok()) return s;
    if (!tensors_.emplace(name, std::move(e)).second) return Error::BadInput(fmt::format("{}: tensor '{}' appears in two files", origin_, name));
  }
  return {};
}

Result<Checkpoint> Checkpoint::Open(const std::string& path) {
  namespace fs = std::filesystem;
  Checkpoint c;
  c.origin_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Error::BadInput(fmt::format("checkpoint '{}' does not exist", path));
  if (!fs::is_directory(path, ec)) {
    if (Status s = c.AddFile(path); !s.ok()) return s.error();
    return c;
  }
  const fs::path dir(path);
  if (fs::exists(dir / "model.safetensors", ec)) {
    if (Status s = c.AddFile((dir / "model.safetensors").string()); !s.ok()) return s.error();
    return c;
  }
  const std::string index = (dir / "model.safetensors.index.json").string();
  if (!fs::exists(index, ec)) {
    const bool pickled = fs::exists(dir / "pytorch_model.bin", ec) || fs::exists(dir / "pytorch_model.bin.index.json", ec);
    return Error::BadInput(fmt::format("checkpoint directory '{}' has neither model.safetensors nor model.safetensors.index.json{}", path,
                                       pickled ? " (pytorch_model.bin is not read: save it again with transformers' save_pretrained)" : ""));
  }
  auto json = LoadJsonFile(index);
  if (!json.ok()) return json.error();
  const Json& j = json.value();
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return Error::BadInput(fmt::format("{}: expected an object with a 'weight_map' object", index));
  }
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
      return Error::BadInput(fmt::format("{}: weight_map entry '{}' must name a file in the directory", index, name));
    }
    files.insert(file.get<std::string>());
  }
  for (const std::string& f : files) {
    if (Status s = c.AddFile((dir / f).string()); !s.ok()) return s.error();
  }
  return c;
}

uint64_t Checkpoint::Fingerprint() const {
  uint64_t h = kFnv1aOffsetBasis;
  auto mix = [&](const std::string& text) { h = Fnv1a("\xFF", Fnv1a(text, h)); };  // 0xFF separates the fields
  for (const auto& [name, e] : tensors_) {  // std::map: the same order on every rank
    mix(name);
    mix(e.dtype);
    mix(ShapeText(e.shape));
    mix(std::to_string(e.bytes));
  }
  return h;
}

Status Checkpoint::Check(const std::string& name, const std::vector<int64_t>& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return Error::BadInput(fmt::format("checkpoint '{}' has no tensor '{}'", origin_, name));
  const Entry& e = it->second;
  if (e.shape != shape) {
    return Error::BadInput(fmt::format("{}: tensor '{}' has shape {}, the model's config needs {}", e.file, name, ShapeText(e.shape), ShapeText(shape)));
  }
  if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16") {
    return Error::BadInput(fmt::format("{}: tensor '{}' is {}; fsdp-run reads F32, BF16 and F16", e.file, name, e.dtype));
  }
  return {};
}

Status Checkpoint::Read(const std::string& name, const std::vector<int64_t>& shape, float* out) const {
  if (Status s = Check(name, shape); !s.ok()) return s;
  const Entry& e = tensors_.at(name);
  const int64_t element = ElementBytes(e.dtype);
  std::vector<char> raw(static_cast<size_t>(e.bytes));
  std::ifstream in(e.file, std::ios::binary);
  if (!in.seekg(e.offset) || !in.read(raw.data(), static_cast<std::streamsize>(raw.size()))) {
    return Error::BadInput(fmt::format("{}: tensor '{}' cannot be read", e.file, name));
  }
  const int64_t numel = e.bytes / element;
  for (int64_t i = 0; i < numel; ++i) {
    const char* p = raw.data() + i * element;
    if (element == 4) {
      std::memcpy(out + i, p, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, p, 2);
      out[i] = e.dtype == "BF16" ? Bf16ToFloat(h) : F16ToFloat(h);
    }
    if (!std::isfinite(out[i])) {
      return Error::BadInput(fmt::format("{}: tensor '{}' holds {} at element {}: a checkpoint to train from must be finite", e.file, name, out[i], i));
    }
  }
  return {};
}

}  // namespace fsdp::runtime
