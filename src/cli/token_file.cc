#include "cli/token_file.h"

#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace fsdp {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

// The decimal id `word` if it is one below `vocab`; -1 otherwise (no sign, no overflow).
int64_t ParseId(std::string_view word, int64_t vocab) {
  int64_t v = 0;
  for (char c : word) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
    if (v >= vocab) return -1;
  }
  return v;
}

}  // namespace

Result<std::vector<int32_t>> ParseTokens(std::string_view text, int64_t vocab, const std::string& origin) {
  std::vector<int32_t> tokens;
  size_t i = 0;
  while (true) {
    while (i < text.size() && IsSpace(text[i])) ++i;
    if (i == text.size()) break;
    size_t end = i;
    while (end < text.size() && !IsSpace(text[end])) ++end;
    const std::string_view word = text.substr(i, end - i);
    const int64_t id = ParseId(word, vocab);
    if (id < 0) {
      const std::string shown = word.size() > 40 ? std::string(word.substr(0, 40)) + "..." : std::string(word);
      return Error::BadInput(fmt::format("{}: token {} '{}' is not an id between 0 and {}", origin, tokens.size() + 1, shown, vocab - 1));
    }
    if (static_cast<int64_t>(tokens.size()) == kMaxTokenFileTokens) {
      return Error::BadInput(fmt::format("{}: more than {} tokens, the most a token file may hold", origin, kMaxTokenFileTokens));
    }
    tokens.push_back(static_cast<int32_t>(id));
    i = end;
  }
  if (tokens.size() < 2) return Error::BadInput(fmt::format("{}: needs at least 2 tokens", origin));
  return tokens;
}

Result<std::vector<int32_t>> ReadTokenFile(const std::string& path, int64_t vocab) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error::BadInput(fmt::format("{}: cannot open token file", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return Error::BadInput(fmt::format("{}: cannot read token file", path));
  return ParseTokens(buffer.str(), vocab, path);
}

}  // namespace fsdp
