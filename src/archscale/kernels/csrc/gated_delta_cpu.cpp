// The gated delta rule's chunk loop (Gated DeltaNet), fused on CPU: forward and backward of the products with
// the state, the part of kernels/gated_delta.py's chunked form that is sequential over chunks (`_scan`,
// `_scan_backward` there, whose docstrings give the maths). The l2-normed keys and queries kq and the per-chunk
// factors eG, eGe, a, Tb and A either come in from torch, batched over all chunks (gated_delta_scan_*: with
// document masks), or are made, and differentiated, at the top and the end of each chunk's step
// (gated_delta_chunk_*: `_KeysOverQueries`, `_factors` and `_factors_backward` there), while the chunk's rows are
// in cache: a layer's rule about 8% faster forward + backward than with them in torch.
//
// The torch loop runs each step as one batched op over every (batch row, head): a (K, V) state per pair, 512 KB
// at K = 256, V = 512, so the states of a batch (4 MB at B4 x 2 heads) leave cache between the ops of a chunk,
// and the ~30 ops per chunk each pay Python's dispatch. Here one task per (batch row, head) walks its chunks with
// its state in L2, and the products are single-threaded gemms (the BLAS torch links) on the chunk's blocks.
//
// Layouts, fp32: kq (n, b, h, 2C, K) contiguous (a chunk's keys over its queries); v, o, do, dv (b, t, h, V) with
// unit inner stride (v and do any other strides, o and dv contiguous); eG, eGe (n, b, h, C), a (n, b, h), Tb, A
// (n, b, h, C, C) contiguous; states (n + 1, b, h, K, V), kqS (n, b, h, 2C, V), u (n, b, h, C, V), or on the
// fused path z (n, b, h, C, V) instead of kqS and u (FwdBuffers), a third of their bytes written and read back,
// which on a 2-core Xeon took the rule's forward + backward from ~55 to ~50 ms a layer.
#include "gated_delta_cpu.h"

#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>  // the streaming stores (x86 only; elsewhere a plain copy)
#endif

#include "cpu_common.h"

namespace {

using archscale_cpu::fast_exp;
using archscale_cpu::mm;
using archscale_cpu::parallel_channels;

struct Dims {
  int64_t n, b, h, C, K, V;
  int64_t bh() const { return b * h; }
  int64_t C2() const { return 2 * C; }
};

Dims dims_of(const torch::Tensor& kq, const torch::Tensor& v) {
  TORCH_CHECK(kq.dim() == 5 && kq.is_contiguous() && kq.scalar_type() == torch::kFloat,
              "gated_delta_cpu: kq must be (n, b, h, 2C, K) contiguous float32");
  TORCH_CHECK(v.dim() == 4 && v.stride(3) == 1 && v.scalar_type() == torch::kFloat,
              "gated_delta_cpu: v must be (b, t, h, V) float32 with unit inner stride");
  const int64_t C = kq.size(3) / 2;
  TORCH_CHECK(v.size(1) == kq.size(0) * C, "gated_delta_cpu: t must be n whole chunks");
  return {kq.size(0), kq.size(1), kq.size(2), C, kq.size(4), v.size(3)};
}

// Rows of a (b, t, h, V) tensor: chunk c of task (bi, hi) starts at row c C, rows `ld` floats apart.
struct Rows {
  float* p;
  int64_t sb, st, sh;
  explicit Rows(const torch::Tensor& x) : p(x.data_ptr<float>()), sb(x.stride(0)), st(x.stride(1)), sh(x.stride(2)) {}
  float* chunk(int64_t task, int64_t h, int64_t c, int64_t C) const {
    return p + (task / h) * sb + (task % h) * sh + c * C * st;
  }
};

// Per-task views of the chunk-major tensors: block c of task j of a (n, b h, rows, cols) tensor.
inline const float* block(const torch::Tensor& x, const Dims& s, int64_t c, int64_t j, int64_t size) {
  return x.data_ptr<float>() + (c * s.bh() + j) * size;
}
inline float* block_mut(torch::Tensor& x, const Dims& s, int64_t c, int64_t j, int64_t size) {
  return x.data_ptr<float>() + (c * s.bh() + j) * size;
}

// out[i, :] = x[i, :] + f * w[i] * y[i, :] over C rows of V (x, out with row strides ldx, ldo; y contiguous).
inline void rows_axpy(int64_t C, int64_t V, const float* x, int64_t ldx, float f, const float* w, const float* y,
                      float* out, int64_t ldo) {
  for (int64_t i = 0; i < C; ++i) {
    const float wi = f * w[i];
    const float* __restrict__ xr = x + i * ldx;
    const float* __restrict__ yr = y + i * V;
    float* __restrict__ o = out + i * ldo;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) o[j] = xr[j] + wi * yr[j];
  }
}

// The per-chunk factors (kernels/gated_delta.py's `_factors`, without document masks), made in the chunk loop
// while the chunk's keys are in cache. In: g, beta (n, b, h, C); out: P = [k k^T; q k^T] (n, b, h, 2C, C),
// M, T (n, b, h, C, C) for the backward, and the loop's eG, eGe (n, b, h, C), a (n, b, h), Tb, A (n, b, h, C, C).
struct Factors {
  torch::Tensor g, beta, P, M, T, eG, eGe, a, Tb, A;
};

// The keys and queries the fused loops read and write in the callers' (b, t, h, K) layout (unit inner stride):
// forward, k and q in and kq = [l2norm(k); l2norm(q)] per chunk out, with rs (n, b, h, 2C) the rows' 1 / norms
// (1 without `normalise`); backward, dk and dq out (contiguous), dx = r (dy - y (y . dy)) from kq's gradient.
struct KeysQueries {
  torch::Tensor kq, rs;
  Rows k, q;
  bool normalise;
};

// y = r x, r = 1 / sqrt(sum x^2 + 1e-6) (or 1), for the rows of chunk c of task j: keys, then queries.
void chunk_keys_queries(const Dims& s, int64_t c, int64_t j, KeysQueries& kq) {
  const int64_t C = s.C, K = s.K;
  float* y = block_mut(kq.kq, s, c, j, s.C2() * K);
  float* r = block_mut(kq.rs, s, c, j, s.C2());
  for (int half = 0; half < 2; ++half) {
    const Rows& x = half ? kq.q : kq.k;
    const float* src = x.chunk(j, s.h, c, C);
    for (int64_t i = 0; i < C; ++i) {
      const float* xi = src + i * x.st;
      float* yi = y + (half * C + i) * K;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < K; ++d) ss += xi[d] * xi[d];
      const float ri = kq.normalise ? 1.0f / std::sqrt(ss + 1e-6f) : 1.0f;
      r[half * C + i] = ri;
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) yi[d] = xi[d] * ri;
    }
  }
}

// dx = r (dy - y (y . dy)) (or dy without `normalise`) for chunk c of task j, from dy = d kq_c (2C x K).
void chunk_keys_queries_backward(const Dims& s, int64_t c, int64_t j, const KeysQueries& kq, const float* dy,
                                 const Rows& dk, const Rows& dq) {
  const int64_t C = s.C, K = s.K;
  const float* y = block(kq.kq, s, c, j, s.C2() * K);
  const float* r = block(kq.rs, s, c, j, s.C2());
  for (int half = 0; half < 2; ++half) {
    float* dst = (half ? dq : dk).chunk(j, s.h, c, C);
    const int64_t st = (half ? dq : dk).st;
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = half * C + i;
      const float *yi = y + row * K, *gi = dy + row * K;
      float* out = dst + i * st;
      if (!kq.normalise) {
        std::copy(gi, gi + K, out);
        continue;
      }
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < K; ++d) dot += yi[d] * gi[d];
      const float ri = r[row];
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) out[d] = ri * (gi[d] - yi[d] * dot);
    }
  }
}

// G = the chunk's cumsum of g (in double, as torch's cumsum); M[i, j] = exp(G_i - G_j) for j <= i (exponent
// clamped at -87 as there), else 0; eG = exp(G), eGe = exp(G_end - G), a = exp(G_end); T = (I + L)^-1 with
// L = diag(beta) (k k^T * M) strictly lower, by forward substitution (row i of T = e_i - sum_{m < i} L[i, m]
// T[m, :]; rows are 0 right of the diagonal); Tb = T diag(beta); A = scale (q k^T * M).
void chunk_factors(const Dims& s, int64_t c, int64_t j, const float* kq_c, Factors& f, float scale,
                   std::vector<float>& G) {
  const int64_t C = s.C, C2 = s.C2();
  const float* g = block(f.g, s, c, j, C);
  const float* beta = block(f.beta, s, c, j, C);
  float* P = block_mut(f.P, s, c, j, C2 * C);
  float *M = block_mut(f.M, s, c, j, C * C), *T = block_mut(f.T, s, c, j, C * C);
  float *Tb = block_mut(f.Tb, s, c, j, C * C), *A = block_mut(f.A, s, c, j, C * C);
  float *eG = block_mut(f.eG, s, c, j, C), *eGe = block_mut(f.eGe, s, c, j, C);
  mm(false, true, C2, C, s.K, kq_c, s.K, kq_c, s.K, 0.0f, P, C);
  double acc = 0.0;
  for (int64_t i = 0; i < C; ++i) G[i] = static_cast<float>(acc += g[i]);
  for (int64_t i = 0; i < C; ++i) {
    eG[i] = fast_exp(G[i]);
    eGe[i] = fast_exp(G[C - 1] - G[i]);
    const float Gi = G[i];
    float* Mi = M + i * C;
#pragma omp simd
    for (int64_t x = 0; x < C; ++x) {
      const float d = Gi - G[x];
      Mi[x] = x <= i ? fast_exp(d < -87.0f ? -87.0f : d) : 0.0f;
    }
  }
  *block_mut(f.a, s, c, j, 1) = eG[C - 1];
  for (int64_t i = 0; i < C; ++i) {
    float* Ti = T + i * C;
    std::fill(Ti, Ti + C, 0.0f);
    Ti[i] = 1.0f;
    for (int64_t m = 0; m < i; ++m) {
      const float l = beta[i] * (P[i * C + m] * M[i * C + m]);
      const float* Tm = T + m * C;
#pragma omp simd
      for (int64_t x = 0; x <= m; ++x) Ti[x] -= l * Tm[x];
    }
#pragma omp simd
    for (int64_t x = 0; x < C; ++x) {
      Tb[i * C + x] = Ti[x] * beta[x];
      A[i * C + x] = P[(C + i) * C + x] * M[i * C + x] * scale;
    }
  }
}

// A state's copy into the saved states, which the backward reads long after: streaming stores where the
// target is 64-byte aligned (no read of the target's lines first; they do not evict the chunk's rows).
inline void stream_copy(const float* src, float* dst, int64_t count) {
#ifdef __AVX512F__
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && count % 16 == 0) {
    for (int64_t x = 0; x < count; x += 16) _mm512_stream_ps(dst + x, _mm512_loadu_ps(src + x));
    return;
  }
#endif
  std::copy(src, src + count, dst);
}

// Where one task's forward keeps its chunk's intermediates. Lean (the fused chunk path): the running state and
// [k S; q S] and u stay in per-thread scratch; each state goes to `states` by `stream_copy`, and z = v - eG k S
// is saved (the backward makes u = Tb z again, and needs neither k S nor q S). Else (the loops behind torch's
// factors): kqS and u are saved for `_scan_backward`, and each state is written straight into `states`.
struct FwdBuffers {
  torch::Tensor states, kqS, u, z;  // kqS, u: empty when lean; z: empty unless lean
  bool lean;
};

struct FwdScratch {
  std::vector<float> eu, G, S, kqS, u;  // eGe u, the chunk's cumsum of g; lean: the running state, kqS, u
  FwdScratch(const Dims& s, bool lean)
      : eu(s.C * s.V), G(s.C), S(lean ? s.K * s.V : 0), kqS(lean ? s.C2() * s.V : 0), u(lean ? s.C * s.V : 0) {}
};

// One task's forward over all chunks (see the file comment for the layouts); with `in`, each chunk's [k; q]
// block is made first from the rows, and with `f` its factors (into f's tensors, the same ones eG ... A name).
void forward_task(const Dims& s, int64_t j, const torch::Tensor& kq, const Rows& v, const Rows& o,
                  const torch::Tensor& eG, const torch::Tensor& eGe, const torch::Tensor& a,
                  const torch::Tensor& Tb, const torch::Tensor& A, FwdBuffers& out, bool has_h0, bool need_last,
                  float scale, FwdScratch& w, Factors* f, KeysQueries* in) {
  const int64_t C = s.C, K = s.K, V = s.V, C2 = s.C2(), KV = K * V;
  if (out.lean) {
    const float* S0 = block(out.states, s, 0, j, KV);
    std::copy(S0, S0 + KV, w.S.data());
  }
  for (int64_t c = 0; c < s.n; ++c) {
    if (in != nullptr) chunk_keys_queries(s, c, j, *in);
    const float* kq_c = block(kq, s, c, j, C2 * K);
    if (f != nullptr) chunk_factors(s, c, j, kq_c, *f, scale, w.G);
    if (out.lean && c > 0) stream_copy(w.S.data(), block_mut(out.states, s, c, j, KV), KV);
    const float* S = out.lean ? w.S.data() : block(out.states, s, c, j, KV);
    float* kqS_c = out.lean ? w.kqS.data() : block_mut(out.kqS, s, c, j, C2 * V);
    float* u_c = out.lean ? w.u.data() : block_mut(out.u, s, c, j, C * V);
    float* z_c = out.lean ? block_mut(out.z, s, c, j, C * V) : w.eu.data();
    const float* eG_c = block(eG, s, c, j, C);
    const float* eGe_c = block(eGe, s, c, j, C);
    if (c || has_h0) mm(false, false, C2, V, K, kq_c, K, S, V, 0.0f, kqS_c, V);   // [k S; q S]
    else std::fill(kqS_c, kqS_c + C2 * V, 0.0f);
    rows_axpy(C, V, v.chunk(j, s.h, c, C), v.st, -1.0f, eG_c, kqS_c, z_c, V);  // z = v - eG k S
    mm(false, false, C, V, C, block(Tb, s, c, j, C * C), C, z_c, V, 0.0f, u_c, V);  // u = Tb z
    float* o_c = o.chunk(j, s.h, c, C);
    const float* qS = kqS_c + C * V;
    for (int64_t i = 0; i < C; ++i) {                                   // o = scale eG q S + A u
      const float w_i = scale * eG_c[i];
#pragma omp simd
      for (int64_t x = 0; x < V; ++x) o_c[i * o.st + x] = w_i * qS[i * V + x];
    }
    mm(false, false, C, V, C, block(A, s, c, j, C * C), C, u_c, V, 1.0f, o_c, o.st);
    if (c < s.n - 1 || need_last) {                                     // S' = a S + k^T (eGe u)
      float* S_next = out.lean ? w.S.data() : block_mut(out.states, s, c + 1, j, KV);
      const float a_c = *block(a, s, c, j, 1);
#pragma omp simd
      for (int64_t x = 0; x < KV; ++x) S_next[x] = a_c * S[x];
      for (int64_t i = 0; i < C; ++i)
#pragma omp simd
        for (int64_t x = 0; x < V; ++x) w.eu[i * V + x] = eGe_c[i] * u_c[i * V + x];
      mm(true, false, K, V, C, kq_c, K, w.eu.data(), V, 1.0f, S_next, V);
      if (out.lean && c == s.n - 1) stream_copy(w.S.data(), block_mut(out.states, s, s.n, j, KV), KV);
    }
  }
#ifdef __AVX512F__
  _mm_sfence();  // the streamed states are in memory before the task ends
#endif
}

std::vector<torch::Tensor> scan_forward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG, torch::Tensor eGe,
                                        torch::Tensor a, torch::Tensor Tb, torch::Tensor A, torch::Tensor h0,
                                        double scale, bool need_last, int64_t threads, Factors* f,
                                        KeysQueries* in) {
  const Dims s = dims_of(kq, v);
  auto opts = kq.options();
  const bool lean = in != nullptr;
  auto none = torch::empty({0}, opts);
  auto o = torch::empty({s.b, s.n * s.C, s.h, s.V}, opts);
  FwdBuffers out{torch::empty({s.n + 1, s.b, s.h, s.K, s.V}, opts),
                 lean ? none : torch::empty({s.n, s.b, s.h, s.C2(), s.V}, opts),
                 lean ? none : torch::empty({s.n, s.b, s.h, s.C, s.V}, opts),
                 lean ? torch::empty({s.n, s.b, s.h, s.C, s.V}, opts) : none, lean};
  const bool has_h0 = h0.numel() > 0;
  if (has_h0) out.states[0].copy_(h0);
  else out.states[0].zero_();
  const Rows vr(v), orows(o);
  parallel_channels(s.bh(), static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    FwdScratch w(s, lean);
    for (int64_t j = begin; j < end; ++j)
      forward_task(s, j, kq, vr, orows, eG, eGe, a, Tb, A, out, has_h0, need_last, static_cast<float>(scale), w, f,
                   in);
  });
  if (lean) return {o, out.states, out.z};
  return {o, out.states, out.kqS, out.u};
}

}  // namespace

std::vector<torch::Tensor> gated_delta_scan_forward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG,
                                                    torch::Tensor eGe, torch::Tensor a, torch::Tensor Tb,
                                                    torch::Tensor A, torch::Tensor h0, double scale, bool need_last,
                                                    int64_t threads) {
  return scan_forward(kq, v, eG, eGe, a, Tb, A, h0, scale, need_last, threads, nullptr, nullptr);
}

std::vector<torch::Tensor> gated_delta_chunk_forward(torch::Tensor k, torch::Tensor q, torch::Tensor v,
                                                     torch::Tensor g, torch::Tensor beta, torch::Tensor h0,
                                                     int64_t C, double scale, bool normalise, bool need_last,
                                                     int64_t threads) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == q.sizes() && k.stride(3) == 1 && q.stride(3) == 1 &&
                  k.scalar_type() == torch::kFloat && q.scalar_type() == torch::kFloat && C > 0 && k.size(1) % C == 0,
              "gated_delta_cpu: k, q must be (b, t, h, K) float32 with unit inner stride, t whole chunks");
  const int64_t n = k.size(1) / C, b = k.size(0), h = k.size(2), K = k.size(3);
  TORCH_CHECK(g.sizes() == torch::IntArrayRef({n, b, h, C}) && g.is_contiguous() && beta.sizes() == g.sizes() &&
                  beta.is_contiguous() && g.scalar_type() == torch::kFloat && beta.scalar_type() == torch::kFloat,
              "gated_delta_cpu: g and beta must be (n, b, h, C) contiguous float32");
  auto opts = k.options();
  KeysQueries in{torch::empty({n, b, h, 2 * C, K}, opts), torch::empty({n, b, h, 2 * C}, opts), Rows(k), Rows(q),
                 normalise};
  auto square = [&] { return torch::empty({n, b, h, C, C}, opts); };
  Factors f{g, beta, torch::empty({n, b, h, 2 * C, C}, opts), square(), square(), torch::empty_like(g),
            torch::empty_like(g), torch::empty({n, b, h}, opts), square(), square()};
  auto out = scan_forward(in.kq, v, f.eG, f.eGe, f.a, f.Tb, f.A, h0, scale, need_last, threads, &f, &in);
  for (const auto& x : {in.kq, in.rs, f.P, f.M, f.T, f.eG, f.eGe, f.a, f.Tb, f.A}) out.push_back(x);
  return out;
}

namespace {

struct Grads {
  torch::Tensor dkq, dv, gG, gGe, ga, dTb, dA, dh0;
};

struct Scratch {
  std::vector<float> du, kdS, ue, z, u, dkqS, dS, X, Y, dP, sums, dkq;
  Scratch(const Dims& s, bool fused)
      : du(s.C * s.V), kdS(s.C * s.V), ue(s.C * s.V), z(fused ? 0 : s.C * s.V), u(fused ? s.C * s.V : 0),
        dkqS(s.C2() * s.V), dS(s.K * s.V), X(s.C * s.C), Y(s.C * s.C), dP(s.C2() * s.C), sums(2 * s.C),
        dkq(fused ? s.C2() * s.K : 0) {}
};

// The gradients of the chunk's factors (kernels/gated_delta.py's `_factors_backward`, without document masks),
// given the chunk loop's dTb, dA and dlog = (gG, gGe, ga) for chunk c: dbeta and dg (n, b, h, C) written, the keys'
// and queries' part added into dkq_c. dL * M = -(T^T (dTb diag(beta)) T^T) strictly lower, times M; dP = [beta
// dL * M; scale dA * M]; E = dM * M = beta (dL * M * k k^T) + dP_q * q k^T; dG = rows of E - columns of E + gG -
// gGe (+ sum gGe + ga at the end); dg = dG's reverse cumsum; dkq += dP k, dk += dP^T kq.
void chunk_factors_backward(const Dims& s, int64_t c, int64_t j, const float* kq_c, const Factors& f,
                            const Grads& g, float* dkq_c, torch::Tensor& dg_t, torch::Tensor& dbeta_t, float scale,
                            Scratch& w) {
  const int64_t C = s.C, C2 = s.C2();
  const float *beta = block(f.beta, s, c, j, C), *P = block(f.P, s, c, j, C2 * C);
  const float *M = block(f.M, s, c, j, C * C), *T = block(f.T, s, c, j, C * C);
  const float *dTb = block(g.dTb, s, c, j, C * C), *dA = block(g.dA, s, c, j, C * C);
  const float *gG = block(g.gG, s, c, j, C), *gGe = block(g.gGe, s, c, j, C);
  float *dg = block_mut(dg_t, s, c, j, C), *dbeta = block_mut(dbeta_t, s, c, j, C);
  float *X = w.X.data(), *Y = w.Y.data(), *dP = w.dP.data(), *rows = w.sums.data(), *cols = rows + C;
  std::fill(dbeta, dbeta + C, 0.0f);
  for (int64_t i = 0; i < C; ++i)
#pragma omp simd
    for (int64_t x = 0; x < C; ++x) {
      X[i * C + x] = dTb[i * C + x] * beta[x];
      dbeta[x] += dTb[i * C + x] * T[i * C + x];
    }
  mm(true, false, C, C, C, T, C, X, C, 0.0f, Y, C);                    // T^T (dTb diag(beta))
  mm(false, true, C, C, C, Y, C, T, C, 0.0f, X, C);                    // ... T^T
  std::fill(cols, cols + C, 0.0f);
  for (int64_t i = 0; i < C; ++i) {
    float row = 0.0f, ek = 0.0f;
    const float bi = beta[i];
#pragma omp simd reduction(+ : row, ek)
    for (int64_t x = 0; x < C; ++x) {
      const float m = M[i * C + x];
      const float dLM = x < i ? -X[i * C + x] * m : 0.0f;
      const float dPq = dA[i * C + x] * m * scale;
      dP[i * C + x] = dLM * bi;
      dP[(C + i) * C + x] = dPq;
      const float e = dLM * P[i * C + x];
      ek += e;
      const float E = e * bi + dPq * P[(C + i) * C + x];
      row += E;
      cols[x] += E;
    }
    dbeta[i] += ek;
    rows[i] = row;
  }
  double tail = *block(g.ga, s, c, j, 1);
  for (int64_t i = 0; i < C; ++i) tail += gGe[i];
  double acc = 0.0;
  for (int64_t i = C - 1; i >= 0; --i) {
    acc += static_cast<double>(rows[i] - cols[i] + gG[i] - gGe[i]) + (i == C - 1 ? tail : 0.0);
    dg[i] = static_cast<float>(acc);
  }
  mm(false, false, C2, s.K, C, dP, C, kq_c, s.K, 1.0f, dkq_c, s.K);     // dkq += dP k
  mm(true, false, C, s.K, C2, dP, C, kq_c, s.K, 1.0f, dkq_c, s.K);      // dk += dP^T kq
}

// [k; q] rows' dots with their gradient rows from d[kS; qS] S^T: gG_i = <d(kS)_i, (kS)_i> + <d(qS)_i, (qS)_i>
// = <(d[kS; qS] S^T)_i, k_i> + <(d[kS; qS] S^T)_{C+i}, q_i>, so the lean path needs neither kS nor qS saved.
void state_read_gate_grads(int64_t C, int64_t K, const float* kq_c, const float* dkq_c, float* gG) {
  for (int64_t i = 0; i < C; ++i) {
    const float *k = kq_c + i * K, *q = kq_c + (C + i) * K, *dk = dkq_c + i * K, *dq = dkq_c + (C + i) * K;
    float acc[16] = {};
    for (int64_t d0 = 0; d0 < K; d0 += 16) {
      const int64_t m = std::min<int64_t>(16, K - d0);
#pragma omp simd
      for (int64_t d = 0; d < m; ++d) acc[d] += dk[d0 + d] * k[d0 + d] + dq[d0 + d] * q[d0 + d];
    }
    float sum = 0.0f;
    for (float x : acc) sum += x;
    gG[i] = sum;
  }
}

// What one task's backward reads of the forward's intermediates (FwdBuffers'): lean, the states and z; else the
// states, kqS and u.
struct BwdSaved {
  torch::Tensor states, kqS, u, z;
  bool lean;
};

// One task's backward over the chunks in reverse (kernels/gated_delta.py's `_scan_backward`); with `f`, each
// chunk's factor gradients follow its step (`_factors_backward`), and with `in` its dk and dq rows, from a
// scratch d[k; q] block.
void backward_task(const Dims& s, int64_t j, const torch::Tensor& kq, const Rows& v, const Rows& dout,
                   const torch::Tensor& eG, const torch::Tensor& eGe, const torch::Tensor& a,
                   const torch::Tensor& Tb, const torch::Tensor& A, const BwdSaved& saved, const float* dlast,
                   Grads& g, const Rows& dv, bool zero_start, bool want_dh0, float scale, Scratch& w,
                   const Factors* f, torch::Tensor* dg, torch::Tensor* dbeta, const KeysQueries* in, const Rows* dk,
                   const Rows* dq) {
  const int64_t C = s.C, K = s.K, V = s.V, C2 = s.C2(), KV = K * V;
  bool have_dS = dlast != nullptr;
  if (have_dS) std::copy(dlast + j * KV, dlast + (j + 1) * KV, w.dS.data());
  for (int64_t c = s.n - 1; c >= 0; --c) {
    const float* kq_c = block(kq, s, c, j, C2 * K);
    const float* S = block(saved.states, s, c, j, KV);
    const float *eG_c = block(eG, s, c, j, C), *eGe_c = block(eGe, s, c, j, C);
    const float* Tb_c = block(Tb, s, c, j, C * C);
    const float* do_c = dout.chunk(j, s.h, c, C);
    const float *z_c, *u_c, *kqS_c = nullptr;
    if (saved.lean) {
      z_c = block(saved.z, s, c, j, C * V);
      mm(false, false, C, V, C, Tb_c, C, z_c, V, 0.0f, w.u.data(), V);                          // u = Tb z
      u_c = w.u.data();
    } else {
      kqS_c = block(saved.kqS, s, c, j, C2 * V);
      rows_axpy(C, V, v.chunk(j, s.h, c, C), v.st, -1.0f, eG_c, kqS_c, w.z.data(), V);          // z
      z_c = w.z.data();
      u_c = block(saved.u, s, c, j, C * V);
    }
    mm(true, false, C, V, C, block(A, s, c, j, C * C), C, do_c, dout.st, 0.0f, w.du.data(), V);  // A^T do
    if (have_dS) {                                                       // the chunk's write into S_{c+1}
      mm(false, false, C, V, K, kq_c, K, w.dS.data(), V, 0.0f, w.kdS.data(), V);              // k dS
      float* gGe_c = block_mut(g.gGe, s, c, j, C);
      for (int64_t i = 0; i < C; ++i) {
        float acc = 0.0f;
        const float e = eGe_c[i];
#pragma omp simd reduction(+ : acc)
        for (int64_t x = 0; x < V; ++x) {
          const float kd = w.kdS[i * V + x];
          w.du[i * V + x] += e * kd;
          const float ue = e * u_c[i * V + x];
          w.ue[i * V + x] = ue;
          acc += ue * kd;
        }
        gGe_c[i] = acc;
      }
      float dot = 0.0f;
      const float* dS = w.dS.data();
#pragma omp simd reduction(+ : dot)
      for (int64_t x = 0; x < KV; ++x) dot += dS[x] * S[x];
      *block_mut(g.ga, s, c, j, 1) = dot * *block(a, s, c, j, 1);
    }
    mm(false, true, C, C, V, do_c, dout.st, u_c, V, 0.0f, block_mut(g.dA, s, c, j, C * C), C);  // do u^T
    mm(false, true, C, C, V, w.du.data(), V, z_c, V, 0.0f, block_mut(g.dTb, s, c, j, C * C), C);  // du z^T
    float* dv_c = dv.chunk(j, s.h, c, C);
    mm(true, false, C, V, C, Tb_c, C, w.du.data(), V, 0.0f, dv_c, dv.st);                      // dz = Tb^T du
    float* gG_c = block_mut(g.gG, s, c, j, C);
    for (int64_t i = 0; i < C; ++i) {                        // d[kS; qS] = [-eG dz; scale eG do]; eG d eG
      float acc = 0.0f;
      const float e = eG_c[i], es = scale * eG_c[i];
      float* __restrict__ dk = w.dkqS.data() + i * V;
      float* __restrict__ dq = w.dkqS.data() + (C + i) * V;
      if (saved.lean) {  // the gate's gradient from the dots below instead
#pragma omp simd
        for (int64_t x = 0; x < V; ++x) {
          dk[x] = -e * dv_c[i * dv.st + x];
          dq[x] = es * do_c[i * dout.st + x];
        }
        continue;
      }
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < V; ++x) {
        dk[x] = -e * dv_c[i * dv.st + x];
        dq[x] = es * do_c[i * dout.st + x];
        acc += dk[x] * kqS_c[i * V + x] + dq[x] * kqS_c[(C + i) * V + x];
      }
      gG_c[i] = acc;
    }
    float* dkq_c = in ? w.dkq.data() : block_mut(g.dkq, s, c, j, C2 * K);  // fused: straight on into dk, dq
    if (c || !zero_start) {
      mm(false, true, C2, K, V, w.dkqS.data(), V, S, V, 0.0f, dkq_c, K);  // d kq S^T
      if (saved.lean) state_read_gate_grads(C, K, kq_c, dkq_c, gG_c);
    } else {
      std::fill(dkq_c, dkq_c + C2 * K, 0.0f);
      if (saved.lean) std::fill(gG_c, gG_c + C, 0.0f);
    }
    if (have_dS) mm(false, true, C, K, V, w.ue.data(), V, w.dS.data(), V, 1.0f, dkq_c, K);  // + (eGe u) dS^T
    if (c || want_dh0) {  // dS_c = a dS + kq^T d[kS; qS]: the gemm scales dS by a (its beta) as it adds
      const float beta = have_dS ? *block(a, s, c, j, 1) : 0.0f;
      mm(true, false, K, V, C2, kq_c, K, w.dkqS.data(), V, beta, w.dS.data(), V);
      have_dS = true;
    }
    if (f != nullptr) chunk_factors_backward(s, c, j, kq_c, *f, g, dkq_c, *dg, *dbeta, scale, w);
    if (in != nullptr) chunk_keys_queries_backward(s, c, j, *in, dkq_c, *dk, *dq);
  }
  if (want_dh0) {
    float* dh0 = g.dh0.data_ptr<float>() + j * KV;
    if (have_dS) std::copy(w.dS.begin(), w.dS.end(), dh0);
    else std::fill(dh0, dh0 + KV, 0.0f);
  }
}

std::vector<torch::Tensor> scan_backward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG, torch::Tensor eGe,
                                         torch::Tensor a, torch::Tensor Tb, torch::Tensor A, const BwdSaved& saved,
                                         torch::Tensor dout, torch::Tensor dlast, double scale, bool zero_start,
                                         bool want_dh0, int64_t threads, const Factors* f, const KeysQueries* in) {
  const Dims s = dims_of(kq, v);
  TORCH_CHECK(dout.sizes() == v.sizes() && dout.stride(3) == 1, "gated_delta_cpu: do must be shaped like v");
  auto opts = kq.options();
  Grads g{in ? torch::empty({0}, opts) : torch::empty_like(kq), torch::empty({s.b, s.n * s.C, s.h, s.V}, opts),
          torch::empty_like(eG), torch::zeros_like(eGe), torch::zeros_like(a), torch::empty_like(Tb),
          torch::empty_like(A), want_dh0 ? torch::empty({s.b, s.h, s.K, s.V}, opts) : torch::empty({0}, opts)};
  torch::Tensor dg = f ? torch::empty_like(eG) : torch::empty({0}, opts), dbeta = torch::empty_like(dg);
  torch::Tensor dk = torch::empty({in ? s.b : 0, s.n * s.C, s.h, s.K}, opts);  // (b, t, h, K) rows, or none
  torch::Tensor dq = torch::empty_like(dk);
  const float* dl = dlast.numel() ? dlast.data_ptr<float>() : nullptr;
  const Rows vr(v), dr(dout), dvr(g.dv), dkr(dk), dqr(dq);
  parallel_channels(s.bh(), static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    Scratch w(s, in != nullptr);
    for (int64_t j = begin; j < end; ++j)
      backward_task(s, j, kq, vr, dr, eG, eGe, a, Tb, A, saved, dl, g, dvr, zero_start, want_dh0,
                    static_cast<float>(scale), w, f, &dg, &dbeta, in, &dkr, &dqr);
  });
  if (in) return {dk, dq, g.dv, dg, dbeta, g.dh0};
  return {g.dkq, g.dv, g.gG, g.gGe, g.ga, g.dTb, g.dA, g.dh0};
}

}  // namespace

std::vector<torch::Tensor> gated_delta_scan_backward(torch::Tensor kq, torch::Tensor v, torch::Tensor eG,
                                                     torch::Tensor eGe, torch::Tensor a, torch::Tensor Tb,
                                                     torch::Tensor A, torch::Tensor states, torch::Tensor kqS,
                                                     torch::Tensor u, torch::Tensor dout, torch::Tensor dlast,
                                                     double scale, bool zero_start, bool want_dh0,
                                                     int64_t threads) {
  const BwdSaved saved{states, kqS, u, torch::Tensor(), false};
  return scan_backward(kq, v, eG, eGe, a, Tb, A, saved, dout, dlast, scale, zero_start, want_dh0, threads, nullptr,
                       nullptr);
}

std::vector<torch::Tensor> gated_delta_chunk_backward(torch::Tensor kq, torch::Tensor rs, torch::Tensor v,
                                                      torch::Tensor beta, torch::Tensor P, torch::Tensor M,
                                                      torch::Tensor T, torch::Tensor eG, torch::Tensor eGe,
                                                      torch::Tensor a, torch::Tensor Tb, torch::Tensor A,
                                                      torch::Tensor states, torch::Tensor z, torch::Tensor dout,
                                                      torch::Tensor dlast, double scale, bool normalise,
                                                      bool zero_start, bool want_dh0, int64_t threads) {
  const Factors f{torch::Tensor(), beta, P, M, T, eG, eGe, a, Tb, A};  // g: the backward needs only its cumsum's
  for (const auto& x : {rs, beta, P, M, T, eG, eGe, a, Tb, A, states, z})
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat,
                "gated_delta_cpu: the saved factors and states must be contiguous float32");
  const KeysQueries in{kq, rs, Rows(kq), Rows(kq), normalise};  // the rows are written through dk, dq here
  const BwdSaved saved{states, torch::Tensor(), torch::Tensor(), z, true};
  return scan_backward(kq, v, eG, eGe, a, Tb, A, saved, dout, dlast, scale, zero_start, want_dh0, threads, &f, &in);
}
