// Locating catalog entries (models/<id>.json, hardware/<id>.json) by id or by path.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace fsdp {

/// The directory that holds models/ and hardware/: $FSDPKIT_DATA_DIR if set, else the source tree
/// the binaries were built from.
std::string DataDir();

/// Ids (file stems) of the JSON files in DataDir()/<folder>, sorted.
std::vector<std::string> ListCatalogIds(const std::string& folder);

/// Maps a --model/--gpu argument to a file path. An argument that names an existing file, ends in
/// ".json" or contains '/' is a path; anything else is an id looked up in DataDir()/<folder>, then
/// in DataDir()/<folder>/unlisted (entries ListCatalogIds leaves out).
/// Unknown ids give BadInput "unknown <what> 'x' (did you mean a, b?; known: ...)".
Result<std::string> ResolveCatalogPath(const std::string& folder, const std::string& what, const std::string& arg);

/// Levenshtein distance, case-insensitive.
int EditDistance(const std::string& a, const std::string& b);
/// Up to `max_count` entries of `candidates` closest to `query` (distance <= max(2, |query|/3)).
std::vector<std::string> ClosestIds(const std::string& query, const std::vector<std::string>& candidates, size_t max_count = 3);

}  // namespace fsdp
