// Reading a HuggingFace checkpoint in the safetensors format (what save_pretrained writes): an
// 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
// tensors' bytes. Used by fsdp-run --init-from to start from real weights.
// Format: https://github.com/huggingface/safetensors (README, "Format").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace fsdp::runtime {

class Checkpoint {
 public:
  /// Opens `path`: a .safetensors file, or a directory holding model.safetensors or a sharded
  /// model.safetensors.index.json (its weight_map names each tensor's file). Reads the headers
  /// only. BadInput naming the file for a missing file, a header that is not valid JSON or whose
  /// offsets, shapes or dtypes are inconsistent with the file.
  static Result<Checkpoint> Open(const std::string& path);

  /// The checkpoint of one file from its first bytes: `head` holds the 8-byte header length and
  /// the JSON header (what AddFile reads), `file_bytes` is the whole file's size. Open's errors.
  static Result<Checkpoint> FromHead(const std::string& file, std::string_view head, uint64_t file_bytes);

  bool Has(const std::string& name) const { return tensors_.count(name) != 0; }
  /// Number of tensors in the checkpoint.
  size_t size() const { return tensors_.size(); }
  /// A hash of every tensor's name, dtype, shape and size in bytes (not of the values): ranks that
  /// opened different checkpoints (different paths on different nodes) disagree on it.
  uint64_t Fingerprint() const;

  /// Tensor `name`'s shape; empty when the checkpoint does not have it.
  std::vector<int64_t> ShapeOf(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? std::vector<int64_t>{} : it->second.shape;
  }
  /// BadInput when tensor `name` is absent, when its shape is not `shape`, or when its dtype is
  /// not one Read converts (F32, BF16, F16).
  Status Check(const std::string& name, const std::vector<int64_t>& shape) const;
  /// Reads tensor `name` into out (numel floats, converted to fp32; the file's bytes are taken as
  /// little-endian, as safetensors stores them); Check's errors, or BadInput if the file is short.
  Status Read(const std::string& name, const std::vector<int64_t>& shape, float* out) const;

 private:
  struct Entry {
    std::string file;            ///< path of the .safetensors file holding it
    std::string dtype;           ///< safetensors dtype: F32, BF16, F16, ...
    std::vector<int64_t> shape;
    int64_t offset = 0;          ///< absolute byte offset in the file
    int64_t bytes = 0;
  };
  Status AddFile(const std::string& file);
  Status AddHead(const std::string& file, std::string_view head, uint64_t file_bytes);
  std::string origin_;  ///< the path given to Open, for messages
  std::map<std::string, Entry> tensors_;
};

}  // namespace fsdp::runtime
