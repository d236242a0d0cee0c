// Mamba-2's SSD scan, the chunked (block) form, fused on CPU: forward and backward.
//
// The torch chunked path (ssd.py) is right but memory-bound on CPU: its (Q, Q) decays, the dt * x, the copies
// into matmul layouts, the masks and autograd's sums are each a pass over (batch, length, heads, ...) tensors.
// Here one (batch, head) pair walks its chunks in order, every block it touches (Q x Q decays, Q x p inputs,
// the p x n state) in L2, and the products are gemms on those blocks (torch's own BLAS, one thread each inside
// torch's OpenMP pool). Nothing of size length x Q per head is written. The backward runs a group's heads in one
// task, which accumulates the group's gradients of B, C and C B^T in place (split into per-set partial sums
// only when there are fewer (batch, group) pairs than threads); a last pass over (batch, group, chunk) takes
// C B^T's gradient through its product.
//
// Semantics (ssd.py's reference): per head, dt_t > 0 (after bias and softplus, done in torch), A < 0,
//     H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T      (p x n; H_{-1} = h0 or 0; a document start zeroes it)
//     y_t = H_t C_t + D x_t
// Chunk c (positions t0 .. t0 + Qc - 1; the last chunk may be shorter), with acum the within-chunk cumsum of
// dt A and r_l the document starts at or before position l in the chunk:
//     M[l, s]  = (C_l . B_s) exp(acum_l - acum_s)   for s <= l and r_s = r_l, else 0      (CB computed once
//                                                                                           per (batch, group))
//     y        = M (dt x) + diag(eA) C S_c^T + D x,  eA_l = exp(acum_l) if r_l = 0 else 0
//     S_{c+1}  = a S_c + (te * dt x)^T B,             te_s = exp(acum_last - acum_s) if r_s = r_last, a =
//                                                     exp(acum_last) if r_last = 0 (else 0)
// The forward saves S_c for every chunk (and the final state) and C B^T; the backward recomputes the rest.
// Layouts, fp32: x (b, L, h, p) and B, C (b, L, g, n) with any batch and time strides (unit inner strides);
// dt (b, L, h) contiguous; starts (b, L) bool or empty; D (h, p) or empty; h0 (b, h, p, n) or empty.

#include "ssd_cpu.h"

#include <algorithm>
#include <vector>

#include "cpu_common.h"

// The BLAS torch links (MKL in the x86 wheels) exports the Fortran sgemm_; torch's own C++ gemm wrapper is not
// exported. Weak: where no sgemm_ is found the products run through at::mm instead (same results, slower).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

using archscale_cpu::fast_exp;
using archscale_cpu::parallel_channels;

// A row-major M x K matrix (K x M stored when t) at p with leading dimension ld, as a tensor view (no copy).
torch::Tensor matrix(const float* p, bool t, int64_t M, int64_t K, int64_t ld) {
  auto v = torch::from_blob(const_cast<float*>(p), {t ? K : M, t ? M : K}, {ld, 1}, torch::kFloat32);
  return t ? v.t() : v;
}

// Row-major out (M x N, ldo) = op(a) op(b) + beta out, op(a) M x K, op(b) K x N; a stored M x K (K x M when
// ta), b stored K x N (N x K when tb). BLAS is column-major: there this is out^T = op(b)^T op(a)^T.
inline void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* out, int64_t ldo) {
  if (M == 0 || N == 0) return;
  if (sgemm_ != nullptr) {
    const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldo);
    const float one = 1.0f;
    sgemm_(&opa, &opb, &m, &n, &k, &one, b, &la, a, &lb, &beta, out, &lc);
    return;
  }
  auto o = torch::from_blob(out, {M, N}, {ldo, 1}, torch::kFloat32);
  auto prod = at::mm(matrix(a, ta, M, K, lda), matrix(b, tb, K, N, ldb));
  if (beta == 0.0f) o.copy_(prod);
  else o.mul_(beta).add_(prod);
}

struct Dims {
  int64_t b, L, h, p, g, n, Q, nc;
};

// Read-only inputs with their strides (in floats).
struct In {
  const float *x, *dt, *A, *B, *C, *D, *h0;
  const bool* starts;
  int64_t sxb, sxt, sbb, sbt, scb, sct;
  In(const torch::Tensor& x_, const torch::Tensor& dt_, const torch::Tensor& A_, const torch::Tensor& B_,
     const torch::Tensor& C_, const torch::Tensor& starts_, const torch::Tensor& D_, const torch::Tensor& h0_)
      : x(x_.data_ptr<float>()), dt(dt_.data_ptr<float>()), A(A_.data_ptr<float>()), B(B_.data_ptr<float>()),
        C(C_.data_ptr<float>()), D(D_.numel() ? D_.data_ptr<float>() : nullptr),
        h0(h0_.numel() ? h0_.data_ptr<float>() : nullptr), starts(starts_.numel() ? starts_.data_ptr<bool>() : nullptr),
        sxb(x_.stride(0)), sxt(x_.stride(1)), sbb(B_.stride(0)), sbt(B_.stride(1)), scb(C_.stride(0)),
        sct(C_.stride(1)) {}
};

Dims dims_of(const torch::Tensor& x, const torch::Tensor& B, int64_t Q) {
  Dims s{x.size(0), x.size(1), x.size(2), x.size(3), B.size(2), B.size(3), Q, (x.size(1) + Q - 1) / Q};
  TORCH_CHECK(x.stride(3) == 1 && x.stride(2) == s.p, "ssd_cpu: x needs unit head and channel strides");
  TORCH_CHECK(B.stride(3) == 1 && B.stride(2) == s.n, "ssd_cpu: B needs unit group and state strides");
  TORCH_CHECK(s.h % s.g == 0, "ssd_cpu: heads must be a multiple of groups");
  return s;
}

// One chunk of one (batch, head) pair: its decay factors (from the chunk's dt, A and document starts).
struct Chunk {
  int64_t t0, Qc;
  float a;                      // exp(acum_last), 0 if a document starts in the chunk
  std::vector<float> acum, eA, te;
  std::vector<int> r;
  explicit Chunk(int64_t Q) : t0(0), Qc(0), a(0), acum(Q), eA(Q), te(Q), r(Q) {}

  void load(const In& in, const Dims& s, int64_t bi, int64_t hh, int64_t c) {
    t0 = c * s.Q;
    Qc = std::min(s.Q, s.L - t0);
    const float Ah = in.A[hh];
    float run = 0.0f;
    int rr = 0;
    for (int64_t l = 0; l < Qc; ++l) {
      const int64_t t = t0 + l;
      run += in.dt[(bi * s.L + t) * s.h + hh] * Ah;
      if (in.starts && in.starts[bi * s.L + t]) ++rr;
      acum[l] = run;
      r[l] = rr;
    }
    const float last = acum[Qc - 1];
    const int rl = r[Qc - 1];
#pragma omp simd
    for (int64_t l = 0; l < Qc; ++l) {
      eA[l] = r[l] == 0 ? fast_exp(acum[l]) : 0.0f;
      te[l] = r[l] == rl ? fast_exp(last - acum[l]) : 0.0f;
    }
    a = rl == 0 ? fast_exp(last) : 0.0f;
  }

  // decay (Qc x Qc, ld Q): exp(acum_l - acum_s) for s <= l in one document (1 on the diagonal), else 0
  void decays(int64_t Q, float* decay) const {
    const float* __restrict__ ac = acum.data();
    const int* __restrict__ rs = r.data();
    for (int64_t l = 0; l < Qc; ++l) {
      float* __restrict__ row = decay + l * Q;
      const float al = ac[l];
      const int rl = rs[l];
#pragma omp simd
      for (int64_t s2 = 0; s2 < l; ++s2) {
        const float e = fast_exp(al - ac[s2]);
        row[s2] = rs[s2] == rl ? e : 0.0f;
      }
      row[l] = 1.0f;
      std::fill(row + l + 1, row + Qc, 0.0f);
    }
  }
};

// Xs = dt * x for the chunk's rows (Qc x p, ld p)
void scaled_inputs(const In& in, const Dims& s, int64_t bi, int64_t hh, const Chunk& ch, float* Xs) {
  for (int64_t l = 0; l < ch.Qc; ++l) {
    const int64_t t = ch.t0 + l;
    const float d = in.dt[(bi * s.L + t) * s.h + hh];
    const float* xr = in.x + bi * in.sxb + t * in.sxt + hh * s.p;
    for (int64_t k = 0; k < s.p; ++k) Xs[l * s.p + k] = d * xr[k];
  }
}

// CB[b, g, c] = C_c B_c^T (Qc x Qc, ld Q), once per (batch, group, chunk)
void chunk_products(const In& in, const Dims& s, float* CB, int threads) {
  parallel_channels(s.b * s.g * s.nc, threads, [&](int, int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / (s.g * s.nc), gi = (task / s.nc) % s.g, c = task % s.nc;
      const int64_t t0 = c * s.Q, Qc = std::min(s.Q, s.L - t0);
      mm(false, true, Qc, Qc, s.n, in.C + bi * in.scb + t0 * in.sct + gi * s.n, in.sct,
         in.B + bi * in.sbb + t0 * in.sbt + gi * s.n, in.sbt, 0.0f, CB + task * s.Q * s.Q, s.Q);
    }
  });
}

void forward_pair(const In& in, const Dims& s, int64_t bi, int64_t hh, const float* CB, float* y, float* states,
                  Chunk& ch, float* M, float* Xs, float* Ce) {
  const int64_t gi = hh / (s.h / s.g), Q = s.Q, P = s.p, N = s.n, ldy = s.h * P;
  float* S = states + (bi * s.h + hh) * (s.nc + 1) * P * N;  // S_c at S + c P N
  if (in.h0) std::copy_n(in.h0 + (bi * s.h + hh) * P * N, P * N, S);
  else std::fill_n(S, P * N, 0.0f);
  for (int64_t c = 0; c < s.nc; ++c) {
    ch.load(in, s, bi, hh, c);
    const int64_t Qc = ch.Qc, t0 = ch.t0;
    const float* cb = CB + ((bi * s.g + gi) * s.nc + c) * Q * Q;
    ch.decays(Q, M);
    for (int64_t l = 0; l < Qc; ++l)
      for (int64_t s2 = 0; s2 <= l; ++s2) M[l * Q + s2] *= cb[l * Q + s2];
    scaled_inputs(in, s, bi, hh, ch, Xs);
    float* yb = y + (bi * s.L + t0) * ldy + hh * P;
    mm(false, false, Qc, P, Qc, M, Q, Xs, P, 0.0f, yb, ldy);
    const float* Sc = S + c * P * N;
    const float* Cb = in.C + bi * in.scb + t0 * in.sct + gi * N;
    if (c > 0 || in.h0) {  // the state entering the chunk, read by every position before a document start
      for (int64_t l = 0; l < Qc; ++l)
        for (int64_t k = 0; k < N; ++k) Ce[l * N + k] = ch.eA[l] * Cb[l * in.sct + k];
      mm(false, true, Qc, P, N, Ce, N, Sc, N, 1.0f, yb, ldy);
    }
    if (in.D) {
      const float* Dh = in.D + hh * P;
      for (int64_t l = 0; l < Qc; ++l) {
        const float* xr = in.x + bi * in.sxb + (t0 + l) * in.sxt + hh * P;
        for (int64_t k = 0; k < P; ++k) yb[l * ldy + k] += Dh[k] * xr[k];
      }
    }
    float* Sn = S + (c + 1) * P * N;
    for (int64_t i = 0; i < P * N; ++i) Sn[i] = ch.a * Sc[i];
    for (int64_t l = 0; l < Qc; ++l)
      for (int64_t k = 0; k < P; ++k) Xs[l * P + k] *= ch.te[l];
    mm(true, false, P, N, Qc, Xs, P, in.B + bi * in.sbb + t0 * in.sbt + gi * N, in.sbt, 1.0f, Sn, N);
  }
}


// Per-thread scratch of the backward, one chunk's blocks.
struct Scratch {
  Chunk ch;
  std::vector<float> decay, M, dM, Xs, dXs, G, Ce, dCe, dS, dacum, dte, dD;
  explicit Scratch(const Dims& s)
      : ch(s.Q), decay(s.Q * s.Q), M(s.Q * s.Q), dM(s.Q * s.Q), Xs(s.Q * s.p), dXs(s.Q * s.p), G(s.Q * s.p),
        Ce(s.Q * s.n), dCe(s.Q * s.n), dS(s.p * s.n), dacum(s.Q), dte(s.Q), dD(s.p) {}
};

// Gradient buffers: the pair's own (dx, ddt, dA, dD per (batch, head)), dh0, and the group's dB, dC and
// d(C B^T), which the pairs accumulate into: each group's heads are split into `slots` sets, one task each, and
// every set accumulates into its own slot (b, L, g * slots, n) / (b, g * slots, nc, Q, Q), zeroed first. With one
// slot (enough tasks without splitting groups) dB and dC are accumulated in place.
struct Grads {
  const float* gy;
  int64_t sgb, sgt;
  const float* glast;
  float *dx, *ddt, *dA, *dD, *dh0, *dBp, *dCp, *dCBp;
  int64_t slots;
};

// The state's part of one chunk's backward: the write S_{c+1} += (te * Xs)^T B read through dS = dS_{c+1}
// (into dXs, dte and the head's part of the dB rows); returns d a = sum dS * S_c.
float state_write_backward(const In& in, const Dims& s, Scratch& w, const float* Bb, const float* Sc,
                           float* dBh, int64_t ldh) {
  const int64_t Qc = w.ch.Qc, P = s.p, N = s.n;
  mm(false, true, Qc, P, N, Bb, in.sbt, w.dS.data(), N, 0.0f, w.G.data(), P);  // G = B dS^T
  for (int64_t l = 0; l < Qc; ++l) {
    float* g = w.G.data() + l * P;
    const float* xs = w.Xs.data() + l * P;
    float* dxs = w.dXs.data() + l * P;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < P; ++k) {
      acc += g[k] * xs[k];
      dxs[k] += w.ch.te[l] * g[k];
      g[k] = w.ch.te[l] * xs[k];  // G becomes te * Xs, the write's left factor
    }
    w.dte[l] = acc;
  }
  mm(false, false, Qc, N, P, w.G.data(), P, w.dS.data(), N, 1.0f, dBh, ldh);
  float da = 0.0f;
  const float* __restrict__ dS = w.dS.data();
#pragma omp simd reduction(+ : da)
  for (int64_t i = 0; i < P * N; ++i) da += dS[i] * Sc[i];
  return da;
}

// The intra-chunk product's backward: dM = dy Xs^T adds the head's part of d(C B^T) (dM * decay, lower triangle) and
// the decays' gradient into dacum (dM * M, strictly lower: + at l, - at s).
void intra_backward(const Dims& s, Scratch& w, const float* dy, int64_t ldy, float* dCB) {
  const int64_t Qc = w.ch.Qc, Q = s.Q;
  mm(false, true, Qc, Qc, s.p, dy, ldy, w.Xs.data(), s.p, 0.0f, w.dM.data(), Q);
  for (int64_t l = 0; l < Qc; ++l) {
    const float *dm = w.dM.data() + l * Q, *m = w.M.data() + l * Q, *dc = w.decay.data() + l * Q;
    float* out = dCB + l * Q;
    float acc = 0.0f;
    float* __restrict__ dacum = w.dacum.data();
#pragma omp simd reduction(+ : acc)
    for (int64_t s2 = 0; s2 < l; ++s2) {
      const float e = dm[s2] * m[s2];
      acc += e;
      dacum[s2] -= e;
      out[s2] += dm[s2] * dc[s2];
    }
    w.dacum[l] += acc;
    out[l] += dm[l];
  }
}

// The read-out of the entering state, y += diag(eA) C S_c^T: the head's part of the dC rows, eA's gradient into dacum,
// and dS becomes dS_c = a dS_{c+1} + dy^T (eA C).
void readout_backward(const In& in, const Dims& s, Scratch& w, const float* dy, int64_t ldy, const float* Cb,
                      const float* Sc, float* dCh, int64_t ldh, bool dS_zero) {
  const int64_t Qc = w.ch.Qc, P = s.p, N = s.n;
  mm(false, false, Qc, N, P, dy, ldy, Sc, N, 0.0f, w.dCe.data(), N);  // dy S_c
  for (int64_t l = 0; l < Qc; ++l) {
    const float e = w.ch.eA[l];
    const float *dce = w.dCe.data() + l * N, *cr = Cb + l * in.sct;
    float *ce = w.Ce.data() + l * N, *out = dCh + l * ldh;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < N; ++k) {
      acc += dce[k] * cr[k];
      out[k] += e * dce[k];
      ce[k] = e * cr[k];
    }
    w.dacum[l] += e * acc;
  }
  if (!dS_zero)
    for (int64_t i = 0; i < P * N; ++i) w.dS[i] *= w.ch.a;
  mm(true, false, P, N, Qc, dy, ldy, w.Ce.data(), N, dS_zero ? 0.0f : 1.0f, w.dS.data(), N);
}

// dacum -> d(dt A) (a reverse cumsum in the chunk) -> ddt and dA; dx = dt dXs + D dy; dD.
void inputs_backward(const In& in, const Dims& s, int64_t bi, int64_t hh, Scratch& w, const float* dy,
                     int64_t ldy, const Grads& gr, float& dA) {
  const int64_t Qc = w.ch.Qc, P = s.p, t0 = w.ch.t0;
  const float Ah = in.A[hh];
  const float* Dh = in.D ? in.D + hh * P : nullptr;
  float run = 0.0f;
  for (int64_t l = Qc - 1; l >= 0; --l) {
    run += w.dacum[l];
    const int64_t t = t0 + l;
    const float d = in.dt[(bi * s.L + t) * s.h + hh];
    const float *xr = in.x + bi * in.sxb + t * in.sxt + hh * P, *dxs = w.dXs.data() + l * P, *dyr = dy + l * ldy;
    float* dxr = gr.dx + ((bi * s.L + t) * s.h + hh) * P;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < P; ++k) {
      acc += dxs[k] * xr[k];
      dxr[k] = d * dxs[k] + (Dh ? Dh[k] * dyr[k] : 0.0f);
    }
    if (Dh)
      for (int64_t k = 0; k < P; ++k) w.dD[k] += dyr[k] * xr[k];
    gr.ddt[(bi * s.L + t) * s.h + hh] = Ah * run + acc;
    dA += d * run;
  }
}

void backward_pair(const In& in, const Dims& s, int64_t bi, int64_t hh, int64_t slot, const float* CB,
                   const float* states, bool has_h0, const Grads& gr, Scratch& w) {
  const int64_t gi = hh / (s.h / s.g), Q = s.Q, P = s.p, N = s.n, pair = bi * s.h + hh;
  const int64_t ldh = s.g * gr.slots * N, sl = gi * gr.slots + slot;  // this head's slot among the batch row's
  const float* S = states + pair * (s.nc + 1) * P * N;
  bool dS_zero = gr.glast == nullptr;
  if (!dS_zero) std::copy_n(gr.glast + pair * P * N, P * N, w.dS.data());
  std::fill(w.dD.begin(), w.dD.end(), 0.0f);
  float dA = 0.0f;
  for (int64_t c = s.nc - 1; c >= 0; --c) {
    Chunk& ch = w.ch;
    ch.load(in, s, bi, hh, c);
    const int64_t Qc = ch.Qc, t0 = ch.t0;
    const float* cb = CB + ((bi * s.g + gi) * s.nc + c) * Q * Q;
    ch.decays(Q, w.decay.data());
    for (int64_t l = 0; l < Qc; ++l)
      for (int64_t s2 = 0; s2 < Qc; ++s2) w.M[l * Q + s2] = w.decay[l * Q + s2] * cb[l * Q + s2];
    scaled_inputs(in, s, bi, hh, ch, w.Xs.data());
    const float* dy = gr.gy + bi * gr.sgb + t0 * gr.sgt + hh * P;
    const float *Sc = S + c * P * N, *Bb = in.B + bi * in.sbb + t0 * in.sbt + gi * N,
                *Cb = in.C + bi * in.scb + t0 * in.sct + gi * N;
    float *dBh = gr.dBp + (bi * s.L + t0) * ldh + sl * N, *dCh = gr.dCp + (bi * s.L + t0) * ldh + sl * N;
    mm(true, false, Qc, P, Qc, w.M.data(), Q, dy, gr.sgt, 0.0f, w.dXs.data(), P);  // dXs = M^T dy
    std::fill_n(w.dacum.begin(), Qc, 0.0f);
    std::fill_n(w.dte.begin(), Qc, 0.0f);
    float da = 0.0f;
    if (!dS_zero) {
      da = state_write_backward(in, s, w, Bb, Sc, dBh, ldh);
    }
    intra_backward(s, w, dy, gr.sgt, gr.dCBp + ((bi * s.g * gr.slots + sl) * s.nc + c) * Q * Q);
    if (c > 0 || has_h0) {
      readout_backward(in, s, w, dy, gr.sgt, Cb, Sc, dCh, ldh, dS_zero);
      dS_zero = false;
    }
    const int64_t last = Qc - 1;
    for (int64_t l = 0; l < Qc; ++l) {  // te_l = exp(acum_last - acum_l)
      const float v = ch.te[l] * w.dte[l];
      w.dacum[last] += v;
      w.dacum[l] -= v;
    }
    w.dacum[last] += ch.a * da;  // a = exp(acum_last)
    inputs_backward(in, s, bi, hh, w, dy, gr.sgt, gr, dA);
  }
  gr.dA[pair] = dA;
  if (gr.dD) std::copy(w.dD.begin(), w.dD.end(), gr.dD + pair * P);
  if (gr.dh0) {
    if (dS_zero) std::fill_n(gr.dh0 + pair * P * N, P * N, 0.0f);
    else std::copy_n(w.dS.data(), P * N, gr.dh0 + pair * P * N);
  }
}

// dB, dC (b, L, g, n): the group's slots summed (nothing to sum with one slot: the pairs accumulated in place),
// plus C B^T's gradient (its slots' sum) through the product: dC += d(CB) B, dB += d(CB)^T C.
void group_backward(const In& in, const Dims& s, const Grads& gr, float* dB, float* dC, int threads) {
  const int64_t Q = s.Q, N = s.n, sl = gr.slots, ldp = s.g * sl * N, ldg = s.g * N;
  parallel_channels(s.b * s.g * s.nc, threads, [&](int, int64_t begin, int64_t end) {
    std::vector<float> dCB(Q * Q);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / (s.g * s.nc), gi = (task / s.nc) % s.g, c = task % s.nc;
      const int64_t t0 = c * Q, Qc = std::min(Q, s.L - t0);
      std::fill(dCB.begin(), dCB.end(), 0.0f);
      for (int64_t j = 0; j < sl; ++j) {
        const float* part = gr.dCBp + ((bi * s.g * sl + gi * sl + j) * s.nc + c) * Q * Q;
        for (int64_t i = 0; i < Qc * Q; ++i) dCB[i] += part[i];
      }
      for (int64_t l = 0; sl > 1 && l < Qc; ++l) {
        const int64_t row = bi * s.L + t0 + l;
        float *db = dB + row * ldg + gi * N, *dc = dC + row * ldg + gi * N;
        std::fill_n(db, N, 0.0f);
        std::fill_n(dc, N, 0.0f);
        for (int64_t j = 0; j < sl; ++j) {
          const float *pb = gr.dBp + row * ldp + (gi * sl + j) * N, *pc = gr.dCp + row * ldp + (gi * sl + j) * N;
          for (int64_t k = 0; k < N; ++k) {
            db[k] += pb[k];
            dc[k] += pc[k];
          }
        }
      }
      float *dBb = dB + (bi * s.L + t0) * ldg + gi * N, *dCb = dC + (bi * s.L + t0) * ldg + gi * N;
      mm(false, false, Qc, N, Qc, dCB.data(), Q, in.B + bi * in.sbb + t0 * in.sbt + gi * N, in.sbt, 1.0f, dCb, ldg);
      mm(true, false, Qc, N, Qc, dCB.data(), Q, in.C + bi * in.scb + t0 * in.sct + gi * N, in.sct, 1.0f, dBb, ldg);
    }
  });
}

// Sets per group so that there are at least `threads` tasks: the smallest divisor of the group's heads that
// gives as many (all the heads when none does).
int64_t slots_for(const Dims& s, int64_t threads) {
  const int64_t hg = s.h / s.g, want = (threads + s.b * s.g - 1) / (s.b * s.g);
  for (int64_t k = std::max<int64_t>(want, 1); k < hg; ++k)
    if (hg % k == 0) return k;
  return hg;
}

}  // namespace

// Returns y (b, L, h, p), the states entering every chunk and the final one (b, h, nc + 1, p, n) and C B^T per
// chunk (b, g, nc, Q, Q): the last two are what the backward reads.
std::vector<torch::Tensor> ssd_forward(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                       torch::Tensor C, torch::Tensor starts, torch::Tensor D, torch::Tensor h0,
                                       int64_t chunk, int64_t threads) {
  const Dims s = dims_of(x, B, chunk);
  const In in(x, dt, A, B, C, starts, D, h0);
  auto y = torch::empty({s.b, s.L, s.h, s.p}, x.options());
  auto states = torch::empty({s.b, s.h, s.nc + 1, s.p, s.n}, x.options());
  auto CB = torch::empty({s.b, s.g, s.nc, s.Q, s.Q}, x.options());
  chunk_products(in, s, CB.data_ptr<float>(), static_cast<int>(threads));
  float *py = y.data_ptr<float>(), *pst = states.data_ptr<float>();
  const float* pcb = CB.data_ptr<float>();
  parallel_channels(s.b * s.h, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    Chunk ch(s.Q);
    std::vector<float> M(s.Q * s.Q), Xs(s.Q * s.p), Ce(s.Q * s.n);
    for (int64_t task = begin; task < end; ++task)
      forward_pair(in, s, task / s.h, task % s.h, pcb, py, pst, ch, M.data(), Xs.data(), Ce.data());
  });
  return {y, states, CB};
}

// Gradients {dx (b, L, h, p), ddt (b, L, h), dA (b, h) per pair, dB, dC (b, L, g, n), dD (b, h, p) per pair or
// empty, dh0 (b, h, p, n) or empty} from gy (b, L, h, p; any batch and time strides) and glast (b, h, p, n) or
// empty; the per-pair sums are reduced in torch.
std::vector<torch::Tensor> ssd_backward(torch::Tensor gy, torch::Tensor glast, torch::Tensor x, torch::Tensor dt,
                                        torch::Tensor A, torch::Tensor B, torch::Tensor C, torch::Tensor starts,
                                        torch::Tensor D, torch::Tensor states, torch::Tensor CB, bool has_h0,
                                        int64_t chunk, int64_t threads) {
  const Dims s = dims_of(x, B, chunk);
  const In in(x, dt, A, B, C, starts, D, torch::Tensor());
  TORCH_CHECK(gy.stride(3) == 1 && gy.stride(2) == s.p, "ssd_cpu: gy needs unit head and channel strides");
  auto f = x.options();
  auto dx = torch::empty({s.b, s.L, s.h, s.p}, f), ddt = torch::empty({s.b, s.L, s.h}, f);
  const int64_t slots = slots_for(s, std::max<int64_t>(threads, 1)), per = s.h / s.g / slots;
  auto dA = torch::empty({s.b, s.h}, f), dB = torch::zeros({s.b, s.L, s.g, s.n}, f);
  auto dC = torch::zeros({s.b, s.L, s.g, s.n}, f);
  auto dD = D.numel() ? torch::empty({s.b, s.h, s.p}, f) : torch::empty({0}, f);
  auto dh0 = has_h0 ? torch::empty({s.b, s.h, s.p, s.n}, f) : torch::empty({0}, f);
  auto dBp = slots > 1 ? torch::zeros({s.b, s.L, s.g * slots, s.n}, f) : dB;
  auto dCp = slots > 1 ? torch::zeros({s.b, s.L, s.g * slots, s.n}, f) : dC;
  auto dCBp = torch::zeros({s.b, s.g * slots, s.nc, s.Q, s.Q}, f);
  Grads gr{gy.data_ptr<float>(), gy.stride(0), gy.stride(1), glast.numel() ? glast.data_ptr<float>() : nullptr,
           dx.data_ptr<float>(), ddt.data_ptr<float>(), dA.data_ptr<float>(),
           dD.numel() ? dD.data_ptr<float>() : nullptr, has_h0 ? dh0.data_ptr<float>() : nullptr,
           dBp.data_ptr<float>(), dCp.data_ptr<float>(), dCBp.data_ptr<float>(), slots};
  const float *pst = states.data_ptr<float>(), *pcb = CB.data_ptr<float>();
  parallel_channels(s.b * s.g * slots, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t task = begin; task < end; ++task) {  // (batch, group, slot): the slot's heads in turn
      const int64_t bi = task / (s.g * slots), sl = task % slots, h0 = (task / slots) % s.g * (s.h / s.g) + sl * per;
      for (int64_t hh = h0; hh < h0 + per; ++hh) backward_pair(in, s, bi, hh, sl, pcb, pst, has_h0, gr, w);
    }
  });
  group_backward(in, s, gr, dB.data_ptr<float>(), dC.data_ptr<float>(), static_cast<int>(threads));
  return {dx, ddt, dA, dB, dC, dD, dh0};
}
