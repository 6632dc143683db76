// fsdp-run --tokens: a file of whitespace-separated token ids to train on.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace fsdp {

/// Most token ids a token file may hold (1 GiB as int32): far more than a CPU run trains on, and
/// a bound on what one rank allocates for them.
constexpr int64_t kMaxTokenFileTokens = int64_t{1} << 28;

/// The ids in `text`, each a decimal integer in [0, vocab). BadInput "<origin>: token N '<word>' is
/// not an id between 0 and V-1" (the word cut at 40 bytes), fewer than 2 tokens, or more than
/// kMaxTokenFileTokens.
Result<std::vector<int32_t>> ParseTokens(std::string_view text, int64_t vocab, const std::string& origin);
/// Reads the file at `path` and parses it (BadInput when it cannot be read).
Result<std::vector<int32_t>> ReadTokenFile(const std::string& path, int64_t vocab);

}  // namespace fsdp
