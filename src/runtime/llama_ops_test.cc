#include "runtime/llama_ops.h"

#include <doctest/doctest.h>

#include "runtime/gradient_check.h"

#include <functional>
#include <random>

namespace fsdp::runtime {
namespace {

std::mt19937 rng(1234);

Mat Random(Eigen::Index rows, Eigen::Index cols, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = d(rng);
  return m;
}

// Finite-difference check of `analytic` (same shape as `x`) at 24 sampled entries.
void CheckGradient(Mat& x, const Mat& analytic, const std::function<double()>& loss, const char* what) {
  runtime::CheckGradient(x.data(), x.size(), analytic.data(), loss, rng, 24, what);
}

double Dot(const Mat& a, const Mat& b) { return static_cast<double>(a.cwiseProduct(b).sum()); }

TEST_CASE("linear: dX = dY W, dW = dY^T X") {
  Mat x = Random(5, 4), w = Random(3, 4), r = Random(5, 3);
  auto loss = [&] { return Dot(LinearForward(x, ConstMatMap(w.data(), 3, 4)), r); };
  Mat dw = Mat::Zero(3, 4);
  MatMap dw_map(dw.data(), 3, 4);
  Mat dx = LinearBackward(r, x, ConstMatMap(w.data(), 3, 4), dw_map);
  CheckGradient(x, dx, loss, "x");
  CheckGradient(w, dw, loss, "w");
}

TEST_CASE("RMSNorm backward") {
  Mat x = Random(4, 8);
  Vec w = Vec::Random(8);
  Mat r = Random(4, 8);
  auto loss = [&] {
    Vec inv;
    return Dot(RmsNormForward(x, Eigen::Map<const Vec>(w.data(), 8), 1e-5f, inv), r);
  };
  Vec inv;
  RmsNormForward(x, Eigen::Map<const Vec>(w.data(), 8), 1e-5f, inv);
  Vec dw = Vec::Zero(8);
  Eigen::Map<Vec> dw_map(dw.data(), 8);
  Mat dx = RmsNormBackward(r, x, Eigen::Map<const Vec>(w.data(), 8), inv, dw_map);
  CheckGradient(x, dx, loss, "x");
  Mat wm = Eigen::Map<Mat>(w.data(), 1, 8);
  Mat dwm = Eigen::Map<Mat>(dw.data(), 1, 8);
  auto loss_w = [&] {
    Vec inv2;
    Vec ww = Eigen::Map<Vec>(wm.data(), 8);
    return Dot(RmsNormForward(x, Eigen::Map<const Vec>(ww.data(), 8), 1e-5f, inv2), r);
  };
  CheckGradient(wm, dwm, loss_w, "w");
}

TEST_CASE("RoPE is a rotation: its backward is the inverse rotation") {
  const int64_t heads = 2, head_dim = 4, seq = 3;
  Mat x = Random(6, heads * head_dim), r = Random(6, heads * head_dim);
  auto loss = [&] {
    Mat y = x;
    Rope(y, heads, head_dim, seq, RopeBaseFrequencies(10000.0, head_dim), false);
    return Dot(y, r);
  };
  Mat dx = r;
  Rope(dx, heads, head_dim, seq, RopeBaseFrequencies(10000.0, head_dim), true);
  CheckGradient(x, dx, loss, "x");
  Mat y = x;
  Rope(y, heads, head_dim, seq, RopeBaseFrequencies(10000.0, head_dim), false);
  CHECK(y.row(0).isApprox(x.row(0)));  // position 0 is not rotated
  CHECK(y.norm() == doctest::Approx(x.norm()).epsilon(1e-5));
}

TEST_CASE("causal grouped-query attention backward") {
  const int64_t batch = 2, seq = 4, heads = 4, kv_heads = 2, d = 3;
  Mat q = Random(batch * seq, heads * d), k = Random(batch * seq, kv_heads * d), v = Random(batch * seq, kv_heads * d);
  Mat r = Random(batch * seq, heads * d);
  std::vector<Mat> probs;
  auto loss = [&] {
    std::vector<Mat> p;
    return Dot(AttentionForward(q, k, v, batch, seq, heads, kv_heads, d, p), r);
  };
  AttentionForward(q, k, v, batch, seq, heads, kv_heads, d, probs);
  CHECK(probs[0](0, 1) == 0.0f);  // causal
  CHECK(probs[0].row(2).sum() == doctest::Approx(1.0f));
  Mat dq, dk, dv;
  AttentionBackward(r, q, k, v, probs, batch, seq, heads, kv_heads, d, dq, dk, dv);
  CheckGradient(q, dq, loss, "q");
  CheckGradient(k, dk, loss, "k");
  CheckGradient(v, dv, loss, "v");
}

TEST_CASE("SwiGLU backward") {
  Mat g = Random(3, 5), u = Random(3, 5), r = Random(3, 5);
  auto loss = [&] { return Dot(SwiGluForward(g, u), r); };
  Mat dg, du;
  SwiGluBackward(r, g, u, dg, du);
  CheckGradient(g, dg, loss, "gate");
  CheckGradient(u, du, loss, "up");
}

TEST_CASE("cross-entropy backward and value") {
  Mat logits = Random(4, 6);
  std::vector<int32_t> targets{1, 0, 5, 3};
  Mat d;
  auto loss = [&] {
    Mat tmp;
    return static_cast<double>(CrossEntropy(logits, targets, tmp));
  };
  CrossEntropy(logits, targets, d);
  CheckGradient(logits, d, loss, "logits");
  Mat uniform = Mat::Zero(2, 8), tmp;
  CHECK(CrossEntropy(uniform, {0, 7}, tmp) == doctest::Approx(std::log(8.0f)));
}

TEST_CASE("embedding backward accumulates rows") {
  Mat table = Random(5, 3), r = Random(4, 3);
  std::vector<int32_t> ids{2, 0, 2, 4};
  auto loss = [&] { return Dot(EmbeddingForward(ConstMatMap(table.data(), 5, 3), ids), r); };
  Mat d = Mat::Zero(5, 3);
  MatMap dm(d.data(), 5, 3);
  EmbeddingBackward(r, ids, dm);
  CheckGradient(table, d, loss, "table");
  CHECK(d.row(1).isZero());
}

}  // namespace
}  // namespace fsdp::runtime
