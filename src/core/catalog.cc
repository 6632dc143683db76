#include "core/catalog.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace fsdp {

namespace fs = std::filesystem;

std::string DataDir() {
  const char* env = std::getenv("FSDPKIT_DATA_DIR");
  if (env != nullptr && *env != '\0') return env;
  return FSDP_DEFAULT_DATA_DIR;
}

std::vector<std::string> ListCatalogIds(const std::string& folder) {
  std::vector<std::string> ids;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(DataDir()) / folder, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json") ids.push_back(entry.path().stem().string());
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

int EditDistance(const std::string& a, const std::string& b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> ClosestIds(const std::string& query, const std::vector<std::string>& candidates, size_t max_count) {
  // Ranked by (distance, capped at 1 for prefix matches), then true distance, then name.
  std::vector<std::tuple<int, int, std::string>> scored;
  int limit = std::max<int>(2, static_cast<int>(query.size()) / 3);
  for (const auto& c : candidates) {
    int d = EditDistance(query, c);
    bool prefix = c.rfind(query, 0) == 0 || query.rfind(c, 0) == 0;
    if (d <= limit || prefix) scored.emplace_back(prefix ? std::min(d, 1) : d, d, c);
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < max_count; ++i) out.push_back(std::get<2>(scored[i]));
  return out;
}

Result<std::string> ResolveCatalogPath(const std::string& folder, const std::string& what, const std::string& arg) {
  if (arg.empty()) return Error::BadInput(fmt::format("empty {} name", what));
  std::error_code ec;
  bool looks_like_path = arg.find('/') != std::string::npos || arg.ends_with(".json");
  if (looks_like_path || fs::is_regular_file(arg, ec)) {
    if (!fs::is_regular_file(arg, ec)) return Error::BadInput(fmt::format("{} file '{}' does not exist", what, arg));
    return arg;
  }
  fs::path path = fs::path(DataDir()) / folder / (arg + ".json");
  if (fs::is_regular_file(path, ec)) return path.string();
  // Entries that are not offered for the catalog's searches (hardware/unlisted/: cards not rented
  // by the hour) still resolve by their id.
  fs::path unlisted = fs::path(DataDir()) / folder / "unlisted" / (arg + ".json");
  if (fs::is_regular_file(unlisted, ec)) return unlisted.string();
  auto ids = ListCatalogIds(folder);
  auto close = ClosestIds(arg, ids);
  std::string hint = close.empty() ? "" : fmt::format(" (did you mean {}?)", fmt::join(close, ", "));
  return Error::BadInput(fmt::format("unknown {} '{}'{}; known: {}", what, arg, hint, fmt::join(ids, ", ")));
}

}  // namespace fsdp
