// Forward and backward of the operations of a Llama-style decoder, in fp32 with Eigen:
// embedding, RMSNorm, linear, RoPE (HF rotate_half layout), causal grouped-query attention,
// SwiGLU and cross-entropy. Each backward is checked against finite differences in
// llama_ops_test.cc. Shapes are given as (rows, cols); activations are (tokens, features) with
// tokens ordered batch-major (t = b * seq + s).
#pragma once

#include <cstdint>
#include <vector>

#include <Eigen/Dense>

namespace fsdp::runtime {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using Vec = Eigen::VectorXf;

/// out (T, h) = table (V, h) rows at ids (T).
Mat EmbeddingForward(const ConstMatMap& table, const std::vector<int32_t>& ids);
/// d_table (V, h) += rows of d_out at ids.
void EmbeddingBackward(const Mat& d_out, const std::vector<int32_t>& ids, MatMap& d_table);

/// y = x / sqrt(mean(x^2) + eps) * w; saves the per-row inverse RMS in inv_rms (T).
Mat RmsNormForward(const Mat& x, const Eigen::Map<const Vec>& w, float eps, Vec& inv_rms);
/// Returns dx; accumulates dw.
Mat RmsNormBackward(const Mat& dy, const Mat& x, const Eigen::Map<const Vec>& w, const Vec& inv_rms, Eigen::Map<Vec>& dw);

/// y (T, out) = x (T, in) W^T, W (out, in).
Mat LinearForward(const Mat& x, const ConstMatMap& w);
/// Returns dx (T, in); accumulates dW (out, in) += dy^T x.
Mat LinearBackward(const Mat& dy, const Mat& x, const ConstMatMap& w, MatMap& dw);

/// RoPE's inverse frequencies without scaling: theta^(-2i/head_dim) for i < head_dim/2.
std::vector<double> RopeBaseFrequencies(double theta, int64_t head_dim);

/// Rotary embedding in place on x (T, heads * head_dim) for positions t % seq, HF layout
/// (pairs i and i + head_dim/2, angle position * inv_freq[i]). `inverse` applies the transpose
/// (backward).
void Rope(Mat& x, int64_t heads, int64_t head_dim, int64_t seq, const std::vector<double>& inv_freq, bool inverse);

/// The causal softmax probabilities (batch * a blocks of (seq, seq)) of q (T, a*d) against k
/// (T, g*d): AttentionForward's first half, and what --ac selective recomputes.
void AttentionProbs(const Mat& q, const Mat& k, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    std::vector<Mat>& probs);
/// Causal attention with grouped-query heads. q (T, a*d), k and v (T, g*d); returns (T, a*d) and
/// saves the probabilities (batch * a blocks of (seq, seq)).
Mat AttentionForward(const Mat& q, const Mat& k, const Mat& v, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, std::vector<Mat>& probs);
/// dq, dk, dv from d_out.
void AttentionBackward(const Mat& d_out, const Mat& q, const Mat& k, const Mat& v, const std::vector<Mat>& probs, int64_t batch,
                       int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, Mat& dq, Mat& dk, Mat& dv);

/// h = silu(gate) * up.
Mat SwiGluForward(const Mat& gate, const Mat& up);
void SwiGluBackward(const Mat& dh, const Mat& gate, const Mat& up, Mat& d_gate, Mat& d_up);

/// Mean cross-entropy of logits (T, V) against targets (T); returns the loss and d_logits.
float CrossEntropy(const Mat& logits, const std::vector<int32_t>& targets, Mat& d_logits);

}  // namespace fsdp::runtime
