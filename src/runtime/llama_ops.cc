#include "runtime/llama_ops.h"

#include <cmath>

namespace fsdp::runtime {

Mat EmbeddingForward(const ConstMatMap& table, const std::vector<int32_t>& ids) {
  Mat out(static_cast<Eigen::Index>(ids.size()), table.cols());
  for (size_t t = 0; t < ids.size(); ++t) out.row(static_cast<Eigen::Index>(t)) = table.row(ids[t]);
  return out;
}

void EmbeddingBackward(const Mat& d_out, const std::vector<int32_t>& ids, MatMap& d_table) {
  for (size_t t = 0; t < ids.size(); ++t) d_table.row(ids[t]) += d_out.row(static_cast<Eigen::Index>(t));
}

Mat RmsNormForward(const Mat& x, const Eigen::Map<const Vec>& w, float eps, Vec& inv_rms) {
  inv_rms.resize(x.rows());
  Mat y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    inv_rms(t) = 1.0f / std::sqrt(x.row(t).squaredNorm() / static_cast<float>(x.cols()) + eps);
    y.row(t) = (x.row(t) * inv_rms(t)).cwiseProduct(w.transpose());
  }
  return y;
}

// y_i = w_i x_i r with r = (mean(x^2) + eps)^-1/2; dr/dx_j = -r^3 x_j / n:
// dx_j = r (w_j dy_j) - r^3 x_j / n * sum_i (w_i dy_i x_i).
Mat RmsNormBackward(const Mat& dy, const Mat& x, const Eigen::Map<const Vec>& w, const Vec& inv_rms, Eigen::Map<Vec>& dw) {
  Mat dx(x.rows(), x.cols());
  const float n = static_cast<float>(x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const float r = inv_rms(t);
    const auto wdy = dy.row(t).cwiseProduct(w.transpose());
    const float dot = wdy.dot(x.row(t));
    dx.row(t) = wdy * r - x.row(t) * (r * r * r * dot / n);
    dw += (dy.row(t).cwiseProduct(x.row(t)) * r).transpose();
  }
  return dx;
}

Mat LinearForward(const Mat& x, const ConstMatMap& w) { return x * w.transpose(); }

Mat LinearBackward(const Mat& dy, const Mat& x, const ConstMatMap& w, MatMap& dw) {
  dw.noalias() += dy.transpose() * x;
  return dy * w;
}

std::vector<double> RopeBaseFrequencies(double theta, int64_t head_dim) {
  std::vector<double> inv_freq(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  return inv_freq;
}

void Rope(Mat& x, int64_t heads, int64_t head_dim, int64_t seq, const std::vector<double>& inv_freq, bool inverse) {
  const int64_t half = head_dim / 2;
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const double pos = static_cast<double>(t % seq);
    for (int64_t i = 0; i < half; ++i) {
      const double freq = inv_freq[static_cast<size_t>(i)];
      const float c = static_cast<float>(std::cos(pos * freq));
      const float s = static_cast<float>(inverse ? -std::sin(pos * freq) : std::sin(pos * freq));
      for (int64_t h = 0; h < heads; ++h) {
        float& a = x(t, h * head_dim + i);
        float& b = x(t, h * head_dim + i + half);
        const float x1 = a, x2 = b;
        // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        a = x1 * c - x2 * s;
        b = x2 * c + x1 * s;
      }
    }
  }
}

namespace {

// Block (seq, head_dim) of head `h` of batch `b` in a (T, heads * head_dim) matrix.
auto HeadBlock(const Mat& m, int64_t b, int64_t h, int64_t seq, int64_t head_dim) {
  return m.block(b * seq, h * head_dim, seq, head_dim);
}
auto HeadBlock(Mat& m, int64_t b, int64_t h, int64_t seq, int64_t head_dim) {
  return m.block(b * seq, h * head_dim, seq, head_dim);
}

}  // namespace

void AttentionProbs(const Mat& q, const Mat& k, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    std::vector<Mat>& probs) {
  probs.assign(static_cast<size_t>(batch * heads), Mat());
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      Mat s = HeadBlock(q, b, h, seq, head_dim) * HeadBlock(k, b, h / group, seq, head_dim).transpose() * scale;
      for (int64_t i = 0; i < seq; ++i) {
        float m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) m = std::max(m, s(i, j));
        float sum = 0;
        for (int64_t j = 0; j < seq; ++j) {
          s(i, j) = j <= i ? std::exp(s(i, j) - m) : 0.0f;
          sum += s(i, j);
        }
        s.row(i) /= sum;
      }
      probs[static_cast<size_t>(b * heads + h)] = std::move(s);
    }
  }
}

Mat AttentionForward(const Mat& q, const Mat& k, const Mat& v, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, std::vector<Mat>& probs) {
  AttentionProbs(q, k, batch, seq, heads, kv_heads, head_dim, probs);
  Mat out = Mat::Zero(q.rows(), q.cols());
  const int64_t group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      HeadBlock(out, b, h, seq, head_dim) = probs[static_cast<size_t>(b * heads + h)] * HeadBlock(v, b, h / group, seq, head_dim);
    }
  }
  return out;
}

void AttentionBackward(const Mat& d_out, const Mat& q, const Mat& k, const Mat& v, const std::vector<Mat>& probs, int64_t batch,
                       int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, Mat& dq, Mat& dk, Mat& dv) {
  dq = Mat::Zero(q.rows(), q.cols());
  dk = Mat::Zero(k.rows(), k.cols());
  dv = Mat::Zero(v.rows(), v.cols());
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kvh = h / group;
      const Mat& p = probs[static_cast<size_t>(b * heads + h)];
      const Mat d_o = HeadBlock(d_out, b, h, seq, head_dim);
      HeadBlock(dv, b, kvh, seq, head_dim) += p.transpose() * d_o;
      const Mat dp = d_o * HeadBlock(v, b, kvh, seq, head_dim).transpose();
      Mat ds = p.cwiseProduct(dp);
      const Vec row_sums = ds.rowwise().sum();
      ds -= p.cwiseProduct(row_sums.replicate(1, seq));  // dS = P * (dP - rowsum(P * dP))
      ds *= scale;
      HeadBlock(dq, b, h, seq, head_dim) += ds * HeadBlock(k, b, kvh, seq, head_dim);
      HeadBlock(dk, b, kvh, seq, head_dim) += ds.transpose() * HeadBlock(q, b, h, seq, head_dim);
    }
  }
}

Mat SwiGluForward(const Mat& gate, const Mat& up) {
  const Mat sig = (1.0f + (-gate.array()).exp()).inverse().matrix();
  return (gate.array() * sig.array() * up.array()).matrix();
}

void SwiGluBackward(const Mat& dh, const Mat& gate, const Mat& up, Mat& d_gate, Mat& d_up) {
  const auto sig = (1.0f + (-gate.array()).exp()).inverse();
  const auto silu = gate.array() * sig;
  d_up = (dh.array() * silu).matrix();
  d_gate = (dh.array() * up.array() * sig * (1.0f + gate.array() * (1.0f - sig))).matrix();
}

float CrossEntropy(const Mat& logits, const std::vector<int32_t>& targets, Mat& d_logits) {
  d_logits.resize(logits.rows(), logits.cols());
  double loss = 0;
  const float inv_t = 1.0f / static_cast<float>(logits.rows());
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    const float m = logits.row(t).maxCoeff();
    const auto e = (logits.row(t).array() - m).exp();
    const float sum = e.sum();
    loss += std::log(sum) + m - logits(t, targets[t]);
    d_logits.row(t) = (e / sum * inv_t).matrix();
    d_logits(t, targets[t]) -= inv_t;
  }
  return static_cast<float>(loss / static_cast<double>(logits.rows()));
}

}  // namespace fsdp::runtime
