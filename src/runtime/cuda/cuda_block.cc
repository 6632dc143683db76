#include "runtime/cuda/cuda_block.h"

#include <cmath>
#include <tuple>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_gemm.h"
#include "runtime/cuda/cuda_kernels.h"

namespace fsdp::runtime::cuda {

int64_t DeviceBlockCache::Bytes() const {
  int64_t total = 0;
  for (const DeviceBuffer* b : {&n1, &q, &k, &v, &probs, &attn, &x2, &n2, &gate, &up, &mid, &inv1, &inv2}) {
    total += b->empty() ? 0 : DeviceAllocator::RoundUp(b->bytes());
  }
  return total;
}

// The batched products of one (batch b, head slot r): the query heads a = g * rep + r of every kv
// head g form one strided batch of kv_heads matrices.
struct HeadBatch {
  int64_t q_offset, kv_offset, score_offset;
};

static HeadBatch HeadsOf(const DeviceContext& c, int64_t b, int64_t r) {
  const LlamaDims& d = c.dims;
  const int64_t s = c.seq;
  return {b * s * d.heads * d.head_dim + r * d.head_dim, b * s * d.kv_heads * d.head_dim, (b * d.heads + r) * s * s};
}

Status DeviceAttentionProbs(const DeviceContext& c, const void* q, const void* k, void* probs) {
  const LlamaDims& d = c.dims;
  const int64_t s = c.seq, rep = d.heads / d.kv_heads, qld = d.heads * d.head_dim, kvld = d.kv_heads * d.head_dim;
  const DType t = c.dtype;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t r = 0; r < rep; ++r) {
      const HeadBatch h = HeadsOf(c, b, r);
      FSDP_TRY(Gemm(c.blas, t, false, true, s, s, d.head_dim, {Offset(q, h.q_offset, t), qld, rep * d.head_dim},
                    {Offset(k, h.kv_offset, t), kvld, d.head_dim}, Offset(probs, h.score_offset, t), s, 0.0f, d.kv_heads, rep * s * s));
    }
  }
  CausalSoftmaxForward(probs, c.batch * d.heads, s, 1.0f / std::sqrt(static_cast<float>(d.head_dim)), t, c.stream);
  return {};
}

Status DeviceAttentionForward(const DeviceContext& c, const void* q, const void* k, const void* v, void* probs, void* out) {
  FSDP_TRY(DeviceAttentionProbs(c, q, k, probs));
  const LlamaDims& d = c.dims;
  const int64_t s = c.seq, rep = d.heads / d.kv_heads, qld = d.heads * d.head_dim, kvld = d.kv_heads * d.head_dim;
  const DType t = c.dtype;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t r = 0; r < rep; ++r) {
      const HeadBatch h = HeadsOf(c, b, r);
      FSDP_TRY(Gemm(c.blas, t, false, false, s, d.head_dim, s, {Offset(probs, h.score_offset, t), s, rep * s * s},
                    {Offset(v, h.kv_offset, t), kvld, d.head_dim}, Offset(out, h.q_offset, t), qld, 0.0f, d.kv_heads, rep * d.head_dim));
    }
  }
  return {};
}

Status DeviceAttentionBackward(const DeviceContext& c, const void* q, const void* k, const void* v, const void* probs, const void* d_out,
                               void* dq, void* dk, void* dv) {
  const LlamaDims& d = c.dims;
  const int64_t s = c.seq, rep = d.heads / d.kv_heads, qld = d.heads * d.head_dim, kvld = d.kv_heads * d.head_dim, T = c.tokens();
  const DType t = c.dtype;
  FSDP_ALLOC(d_scores, c.Buffer(c.batch * d.heads * s * s, MemCategory::kTemporaries));
  // with grouped heads, dk and dv are first computed per query head, then summed per kv head
  DeviceBuffer dk_heads, dv_heads;
  if (rep > 1) {
    FSDP_ALLOC(a, c.Buffer(T * qld, MemCategory::kTemporaries));
    FSDP_ALLOC(b, c.Buffer(T * qld, MemCategory::kTemporaries));
    dk_heads = std::move(a);
    dv_heads = std::move(b);
  }
  void* dk_out = rep > 1 ? dk_heads.get() : dk;
  void* dv_out = rep > 1 ? dv_heads.get() : dv;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t r = 0; r < rep; ++r) {
      const HeadBatch h = HeadsOf(c, b, r);
      const MatrixArg p{Offset(probs, h.score_offset, t), s, rep * s * s}, dout{Offset(d_out, h.q_offset, t), qld, rep * d.head_dim};
      // dP = dO V^T; dV = P^T dO
      FSDP_TRY(Gemm(c.blas, t, false, true, s, s, d.head_dim, dout, {Offset(v, h.kv_offset, t), kvld, d.head_dim},
                    Offset(d_scores.get(), h.score_offset, t), s, 0.0f, d.kv_heads, rep * s * s));
      FSDP_TRY(Gemm(c.blas, t, true, false, s, d.head_dim, s, p, dout, Offset(dv_out, h.q_offset, t), qld, 0.0f, d.kv_heads, rep * d.head_dim));
    }
  }
  CausalSoftmaxBackward(probs, d_scores.get(), c.batch * d.heads, s, 1.0f / std::sqrt(static_cast<float>(d.head_dim)), t, c.stream);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t r = 0; r < rep; ++r) {
      const HeadBatch h = HeadsOf(c, b, r);
      const MatrixArg ds{Offset(d_scores.get(), h.score_offset, t), s, rep * s * s};
      // dQ = dS K; dK = dS^T Q
      FSDP_TRY(Gemm(c.blas, t, false, false, s, d.head_dim, s, ds, {Offset(k, h.kv_offset, t), kvld, d.head_dim}, Offset(dq, h.q_offset, t),
                    qld, 0.0f, d.kv_heads, rep * d.head_dim));
      FSDP_TRY(Gemm(c.blas, t, true, false, s, d.head_dim, s, ds, {Offset(q, h.q_offset, t), qld, rep * d.head_dim},
                    Offset(dk_out, h.q_offset, t), qld, 0.0f, d.kv_heads, rep * d.head_dim));
    }
  }
  if (rep > 1) {
    SumHeadGroups(dk_heads.get(), dk, T, d.kv_heads, rep, d.head_dim, t, c.stream);
    SumHeadGroups(dv_heads.get(), dv, T, d.kv_heads, rep, d.head_dim, t, c.stream);
  }
  return {};
}

Result<DeviceBuffer> DeviceBlockForward(const DeviceContext& c, const void* params, const DeviceBuffer& x, DeviceBlockCache* cache) {
  const LlamaDims& d = c.dims;
  const LlamaDims::BlockOffsets o = d.Offsets();
  const DType t = c.dtype;
  const int64_t T = c.tokens(), h = d.hidden, qd = d.heads * d.head_dim, kvd = d.kv_heads * d.head_dim, I = d.inner;
  const MemCategory saved = cache != nullptr ? MemCategory::kActivations : MemCategory::kTemporaries;
  auto w = [&](int64_t offset) { return Offset(params, offset, t); };
  FSDP_ALLOC(inv1, c.alloc->Allocate(T * 4, saved, c.stream));
  FSDP_ALLOC(n1, c.Buffer(T * h, saved));
  RmsNormForward(x.get(), w(o.in_norm), n1.get(), inv1.as<float>(), T, h, d.rms_eps, t, c.stream);
  FSDP_ALLOC(q, c.Buffer(T * qd, saved));
  FSDP_ALLOC(k, c.Buffer(T * kvd, saved));
  FSDP_ALLOC(v, c.Buffer(T * kvd, saved));
  if (d.qkv_bias) {  // y = bias + x W^T, one rounding (Qwen2's q/k/v)
    for (auto [out, weight, bias, n] : {std::tuple{q.get(), o.wq, o.bq, qd}, std::tuple{k.get(), o.wk, o.bk, kvd}, std::tuple{v.get(), o.wv, o.bv, kvd}}) {
      BroadcastRows(w(bias), out, T, n, t, c.stream);
      FSDP_TRY(Gemm(c.blas, t, false, true, T, n, h, {n1.get(), h}, {w(weight), h}, out, n, 1.0f));
    }
  } else {
    FSDP_TRY(LinearForward(c.blas, t, n1.get(), w(o.wq), q.get(), T, h, qd));
    FSDP_TRY(LinearForward(c.blas, t, n1.get(), w(o.wk), k.get(), T, h, kvd));
    FSDP_TRY(LinearForward(c.blas, t, n1.get(), w(o.wv), v.get(), T, h, kvd));
  }
  Rope(q.get(), c.rope_table, T, d.heads, d.head_dim, c.seq, false, t, c.stream);
  Rope(k.get(), c.rope_table, T, d.kv_heads, d.head_dim, c.seq, false, t, c.stream);
  FSDP_ALLOC(probs, c.Buffer(c.batch * d.heads * c.seq * c.seq, saved));
  FSDP_ALLOC(attn, c.Buffer(T * qd, saved));
  FSDP_TRY(DeviceAttentionForward(c, q.get(), k.get(), v.get(), probs.get(), attn.get()));
  FSDP_ALLOC(x2, c.Buffer(T * h, saved));  // x2 = x + attn Wo^T
  FSDP_CUDA_TRY(cudaMemcpyAsync(x2.get(), x.get(), static_cast<size_t>(T * h * c.elem()), cudaMemcpyDeviceToDevice, c.stream));
  FSDP_TRY(Gemm(c.blas, t, false, true, T, h, qd, {attn.get(), qd}, {w(o.wo), qd}, x2.get(), h, 1.0f));
  FSDP_ALLOC(inv2, c.alloc->Allocate(T * 4, saved, c.stream));
  FSDP_ALLOC(n2, c.Buffer(T * h, saved));
  RmsNormForward(x2.get(), w(o.post_norm), n2.get(), inv2.as<float>(), T, h, d.rms_eps, t, c.stream);
  FSDP_ALLOC(gate, c.Buffer(T * I, saved));
  FSDP_ALLOC(up, c.Buffer(T * I, saved));
  FSDP_TRY(LinearForward(c.blas, t, n2.get(), w(o.wg), gate.get(), T, h, I));
  FSDP_TRY(LinearForward(c.blas, t, n2.get(), w(o.wu), up.get(), T, h, I));
  FSDP_ALLOC(mid, c.Buffer(T * I, saved));
  SwiGluForward(gate.get(), up.get(), mid.get(), T * I, t, c.stream);
  FSDP_ALLOC(y, c.Buffer(T * h, MemCategory::kActivations));  // y = x2 + mid Wd^T
  FSDP_CUDA_TRY(cudaMemcpyAsync(y.get(), x2.get(), static_cast<size_t>(T * h * c.elem()), cudaMemcpyDeviceToDevice, c.stream));
  FSDP_TRY(Gemm(c.blas, t, false, true, T, h, I, {mid.get(), I}, {w(o.wd), I}, y.get(), h, 1.0f));
  if (cache != nullptr) {
    *cache = DeviceBlockCache{std::move(n1), std::move(q),  std::move(k),  std::move(v),   std::move(probs), std::move(attn), std::move(x2),
                              std::move(n2), std::move(gate), std::move(up), std::move(mid), std::move(inv1), std::move(inv2)};
  }
  FSDP_CUDA_TRY(cudaGetLastError());  // a kernel launch of this block failed (the launchers return nothing)
  return y;
}

Result<DeviceBuffer> DeviceBlockBackward(const DeviceContext& c, const void* params, void* grads, float* dw_scratch, const DeviceBuffer& x,
                                         DeviceBuffer dy, DeviceBlockCache& cache) {
  const LlamaDims& d = c.dims;
  const LlamaDims::BlockOffsets o = d.Offsets();
  const DType t = c.dtype;
  const int64_t T = c.tokens(), h = d.hidden, qd = d.heads * d.head_dim, kvd = d.kv_heads * d.head_dim, I = d.inner;
  auto w = [&](int64_t offset) { return Offset(params, offset, t); };
  auto g = [&](int64_t offset) { return Offset(grads, offset, t); };
  // MLP: y = x2 + swiglu(n2 Wg^T, n2 Wu^T) Wd^T
  FSDP_ALLOC(d_mid, c.Buffer(T * I, MemCategory::kTemporaries));
  FSDP_TRY(LinearBackward(c.blas, t, dy.get(), cache.mid.get(), w(o.wd), d_mid.get(), g(o.wd), T, I, h));
  cache.mid.Release();
  FSDP_ALLOC(d_gate, c.Buffer(T * I, MemCategory::kTemporaries));
  SwiGluBackward(d_mid.get(), cache.gate.get(), cache.up.get(), d_gate.get(), d_mid.get(), T * I, t, c.stream);  // d_up in place of d_mid
  FSDP_ALLOC(d_n2, c.Buffer(T * h, MemCategory::kTemporaries));
  FSDP_TRY(LinearBackward(c.blas, t, d_gate.get(), cache.n2.get(), w(o.wg), d_n2.get(), g(o.wg), T, h, I));
  FSDP_TRY(LinearBackward(c.blas, t, d_mid.get(), cache.n2.get(), w(o.wu), d_n2.get(), g(o.wu), T, h, I, 1.0f));
  d_mid.Release();
  d_gate.Release();
  cache.gate.Release();
  cache.up.Release();
  FSDP_ALLOC(d_x2, c.Buffer(T * h, MemCategory::kTemporaries));
  RmsNormBackward(d_n2.get(), cache.x2.get(), w(o.post_norm), cache.inv2.as<float>(), dy.get(), d_x2.get(), dw_scratch, T, h, t, c.stream);
  AddF32(dw_scratch, g(o.post_norm), t, h, c.stream);
  d_n2.Release();
  dy.Release();
  cache.n2.Release();
  cache.x2.Release();
  cache.inv2.Release();
  // attention: x2 = x + attention(n1) Wo^T
  FSDP_ALLOC(d_attn, c.Buffer(T * qd, MemCategory::kTemporaries));
  FSDP_TRY(LinearBackward(c.blas, t, d_x2.get(), cache.attn.get(), w(o.wo), d_attn.get(), g(o.wo), T, qd, h));
  cache.attn.Release();
  FSDP_ALLOC(dq, c.Buffer(T * qd, MemCategory::kTemporaries));
  FSDP_ALLOC(dk, c.Buffer(T * kvd, MemCategory::kTemporaries));
  FSDP_ALLOC(dv, c.Buffer(T * kvd, MemCategory::kTemporaries));
  FSDP_TRY(DeviceAttentionBackward(c, cache.q.get(), cache.k.get(), cache.v.get(), cache.probs.get(), d_attn.get(), dq.get(), dk.get(), dv.get()));
  d_attn.Release();
  cache.probs.Release();
  Rope(dq.get(), c.rope_table, T, d.heads, d.head_dim, c.seq, true, t, c.stream);
  Rope(dk.get(), c.rope_table, T, d.kv_heads, d.head_dim, c.seq, true, t, c.stream);
  if (d.qkv_bias) {  // bias gradients: the outputs' gradients summed over tokens (dw_scratch holds hidden >= qd floats)
    for (auto [grad, bias, n] : {std::tuple{dq.get(), o.bq, qd}, std::tuple{dk.get(), o.bk, kvd}, std::tuple{dv.get(), o.bv, kvd}}) {
      ColumnSums(grad, dw_scratch, T, n, t, c.stream);
      AddF32(dw_scratch, g(bias), t, n, c.stream);
    }
  }
  FSDP_ALLOC(d_n1, c.Buffer(T * h, MemCategory::kTemporaries));
  FSDP_TRY(LinearBackward(c.blas, t, dq.get(), cache.n1.get(), w(o.wq), d_n1.get(), g(o.wq), T, h, qd));
  FSDP_TRY(LinearBackward(c.blas, t, dk.get(), cache.n1.get(), w(o.wk), d_n1.get(), g(o.wk), T, h, kvd, 1.0f));
  FSDP_TRY(LinearBackward(c.blas, t, dv.get(), cache.n1.get(), w(o.wv), d_n1.get(), g(o.wv), T, h, kvd, 1.0f));
  dq.Release();
  dk.Release();
  dv.Release();
  cache.q.Release();
  cache.k.Release();
  cache.v.Release();
  cache.n1.Release();
  FSDP_ALLOC(dx, c.Buffer(T * h, MemCategory::kActivations));
  RmsNormBackward(d_n1.get(), x.get(), w(o.in_norm), cache.inv1.as<float>(), d_x2.get(), dx.get(), dw_scratch, T, h, t, c.stream);
  AddF32(dw_scratch, g(o.in_norm), t, h, c.stream);
  cache.inv1.Release();
  FSDP_CUDA_TRY(cudaGetLastError());
  return dx;
}

}  // namespace fsdp::runtime::cuda
