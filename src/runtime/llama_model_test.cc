#include "runtime/llama_model.h"

#include <doctest/doctest.h>

#include "runtime/gradient_check.h"

#include <random>

namespace fsdp::runtime {
namespace {

TEST_CASE("a whole decoder block: backward against finite differences") {
  LlamaDims d{11, 8, 12, 4, 2, 2, 1};
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 0.3f);
  std::vector<float> params(static_cast<size_t>(d.BlockNumel()));
  for (auto& v : params) v = n(rng);
  const auto o = d.Offsets();
  for (int64_t i = 0; i < d.hidden; ++i) params[o.in_norm + i] = params[o.post_norm + i] = 1.0f + 0.1f * n(rng);
  const int64_t batch = 2, seq = 3;
  Mat x(batch * seq, d.hidden), r(batch * seq, d.hidden);
  for (Eigen::Index i = 0; i < x.size(); ++i) { x.data()[i] = n(rng); r.data()[i] = n(rng); }
  auto loss = [&] { return static_cast<double>(BlockForward(d, params.data(), x, batch, seq, nullptr).cwiseProduct(r).sum()); };
  BlockCache cache;
  BlockForward(d, params.data(), x, batch, seq, &cache);
  std::vector<float> grads(params.size(), 0.0f);
  Mat dx = BlockBackward(d, params.data(), grads.data(), r, cache, batch, seq);
  CheckGradient(params.data(), static_cast<int64_t>(params.size()), grads.data(), loss, rng, 40, "params");
  CheckGradient(x.data(), x.size(), dx.data(), loss, rng, 20, "x");
}

TEST_CASE("the flat block layout matches the checkpoint inventory") {
  auto m = LoadModel("tiny-llama");
  REQUIRE(m.ok());
  auto d = DimsOf(m.value());
  REQUIRE(d.ok());
  CHECK(d.value().BlockNumel() == m.value().BlockParams(0));
  auto gpt2 = LoadModel("gpt2");
  CHECK_FALSE(DimsOf(gpt2.value()).ok());
}

}  // namespace
}  // namespace fsdp::runtime
