// compare_losses A.json B.json TOLERANCE: exit 0 when every measured.loss of B is within TOLERANCE
// (relative) of A's, 1 otherwise (with the offending step on stderr), 2 on unreadable input.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/json_io.h"

int main(int argc, char** argv) {
  if (argc != 4) { std::fprintf(stderr, "usage: compare_losses A.json B.json TOLERANCE\n"); return 2; }
  auto a = fsdp::LoadJsonFile(argv[1]);
  auto b = fsdp::LoadJsonFile(argv[2]);
  if (!a.ok() || !b.ok()) { std::fprintf(stderr, "%s\n", (!a.ok() ? a.error() : b.error()).message.c_str()); return 2; }
  const double tolerance = std::atof(argv[3]);
  const auto& la = a.value()["measured"]["loss"];
  const auto& lb = b.value()["measured"]["loss"];
  if (la.size() != lb.size() || la.empty()) { std::fprintf(stderr, "different step counts: %zu vs %zu\n", la.size(), lb.size()); return 1; }
  for (size_t i = 0; i < la.size(); ++i) {
    const double x = la[i].get<double>(), y = lb[i].get<double>();
    if (std::fabs(x - y) > tolerance * std::fabs(x)) {
      std::fprintf(stderr, "step %zu: %.9f vs %.9f (relative difference %.2e > %.0e)\n", i + 1, x, y, std::fabs(x - y) / std::fabs(x), tolerance);
      return 1;
    }
  }
  std::printf("%zu losses agree within %.0e\n", la.size(), tolerance);
  return 0;
}
