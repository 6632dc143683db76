// Test helper: compares analytic gradients with central finite differences at sampled entries.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>

namespace fsdp::runtime {

/// For `samples` random entries i of `x` (n floats), checks |analytic[i] - fd_i| <= 2e-2 |fd_i| + 2e-3,
/// where fd_i is the central difference of `loss` with step 1e-2. `x` is restored after each probe.
inline void CheckGradient(float* x, int64_t n, const float* analytic, const std::function<double()>& loss, std::mt19937& rng, int samples,
                          const char* what) {
  std::uniform_int_distribution<int64_t> pick(0, n - 1);
  const float eps = 1e-2f;
  for (int k = 0; k < samples; ++k) {
    const int64_t i = pick(rng);
    const float saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double fd = (up - down) / (2 * eps);
    CAPTURE(what);
    CAPTURE(i);
    CHECK(std::abs(analytic[i] - fd) <= 2e-2 * std::abs(fd) + 2e-3);
  }
}

}  // namespace fsdp::runtime
