// Mamba-2's SSD scan, the chunked (block) form, fused on CPU: forward and backward.
//
// The torch chunked path (ssd.py) is right but memory-bound on CPU: its (Q, Q) decays, the dt * x, the copies
// into matmul layouts, the masks and autograd's sums are each a pass over (batch, length, heads, ...) tensors.
// Here one task (a batch row's group of heads sharing B and C, or a set of them when there are fewer groups than
// threads) walks its chunks in order with the chunk's blocks in cache; the products are gemms on those blocks
// (the BLAS torch links, one thread each inside torch's OpenMP pool): per head the intra-chunk (Q x Q) product,
// and for all the set's heads at once the products with B, C and the states ((heads p) x n), which B and C being
// shared by the heads make one gemm. Nothing of size length x Q per head is written. The backward accumulates
// the group's gradients of B, C and C B^T in place (per-set partial sums when a group was split); a last pass
// over (batch, group, chunk) takes C B^T's gradient through its product.
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

namespace {

using archscale_cpu::fast_exp;
using archscale_cpu::mm;
using archscale_cpu::parallel_channels;

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

// A task's heads: `hs` consecutive heads from `h0`, all in group `gi` of batch row `bi`. Their rows of x, y and
// the gradients are one contiguous span of hs * p channels per position, and their states one (hs p) x n block,
// so the products with B, C and the states are one gemm for the whole set.
struct HeadSet {
  int64_t bi, gi, h0, hs;
};

// Sets per group so that there are at least `threads` tasks: the smallest divisor of the group's heads that
// gives as many (all the heads when none does).
int64_t slots_for(const Dims& s, int64_t threads) {
  const int64_t hg = s.h / s.g, want = (threads + s.b * s.g - 1) / (s.b * s.g);
  for (int64_t k = std::max<int64_t>(want, 1); k < hg; ++k)
    if (hg % k == 0) return k;
  return hg;
}

HeadSet head_set(const Dims& s, int64_t slots, int64_t task) {
  const int64_t per = s.h / s.g / slots, bi = task / (s.g * slots), gi = (task / slots) % s.g;
  return {bi, gi, gi * (s.h / s.g) + (task % slots) * per, per};
}

// One chunk's decay factors for every head of a set (from the chunk's dt, A and document starts), head j's at
// j * Q: acum the within-chunk cumsum of dt A, eA = exp(acum) (0 once a document started in the chunk), te =
// exp(acum_last - acum) (0 before the chunk's last document), a = exp(acum_last) (0 if a document starts in it).
struct Factors {
  int64_t Q, t0 = 0, Qc = 0;
  std::vector<float> acum, eA, te, a;
  std::vector<int> r;  // document starts at or before each position of the chunk (the same for every head)
  Factors(int64_t Q_, int64_t hs) : Q(Q_), acum(hs * Q_), eA(hs * Q_), te(hs * Q_), a(hs), r(Q_) {}

  void load(const In& in, const Dims& s, const HeadSet& set, int64_t c) {
    t0 = c * s.Q;
    Qc = std::min(s.Q, s.L - t0);
    int rr = 0;
    for (int64_t l = 0; l < Qc; ++l) {
      if (in.starts && in.starts[set.bi * s.L + t0 + l]) ++rr;
      r[l] = rr;
    }
    const int rl = r[Qc - 1];
    const int* __restrict__ rs = r.data();
    for (int64_t j = 0; j < set.hs; ++j) {
      const float Ah = in.A[set.h0 + j];
      const float* dtp = in.dt + (set.bi * s.L + t0) * s.h + set.h0 + j;
      float *__restrict__ ac = acum.data() + j * Q, *__restrict__ ea = eA.data() + j * Q,
                        *__restrict__ tt = te.data() + j * Q;
      float run = 0.0f;
      for (int64_t l = 0; l < Qc; ++l) ac[l] = run += dtp[l * s.h] * Ah;
      const float last = ac[Qc - 1];
#pragma omp simd
      for (int64_t l = 0; l < Qc; ++l) {
        ea[l] = rs[l] == 0 ? fast_exp(ac[l]) : 0.0f;
        tt[l] = rs[l] == rl ? fast_exp(last - ac[l]) : 0.0f;
      }
      a[j] = rl == 0 ? fast_exp(last) : 0.0f;
    }
  }

  // head j's M (Qc x Qc, ld Q) = decay * C B^T and, when asked, the decays alone: exp(acum_l - acum_s) for
  // s <= l in one document (1 on the diagonal), else 0
  void masked(int64_t j, const float* cb, float* M, float* decay) const {
    const float* __restrict__ ac = acum.data() + j * Q;
    const int* __restrict__ rs = r.data();
    for (int64_t l = 0; l < Qc; ++l) {
      float* __restrict__ row = M + l * Q;
      const float* __restrict__ cbr = cb + l * Q;
      const float al = ac[l];
      const int rl = rs[l];
#pragma omp simd
      for (int64_t s2 = 0; s2 < l; ++s2) {
        const float e = fast_exp(al - ac[s2]);
        row[s2] = rs[s2] == rl ? e : 0.0f;
      }
      row[l] = 1.0f;
      std::fill(row + l + 1, row + Qc, 0.0f);
      if (decay) std::copy(row, row + Qc, decay + l * Q);
#pragma omp simd
      for (int64_t s2 = 0; s2 <= l; ++s2) row[s2] *= cbr[s2];
    }
  }
};

// Xs (Qc x hs p, ld hs p) = dt * x over the set's heads
void scaled_inputs(const In& in, const Dims& s, const HeadSet& set, const Factors& f, float* Xs) {
  const int64_t P = s.p, W = set.hs * P;
  for (int64_t l = 0; l < f.Qc; ++l) {
    const int64_t t = f.t0 + l;
    const float* xr = in.x + set.bi * in.sxb + t * in.sxt + set.h0 * P;
    const float* dtr = in.dt + (set.bi * s.L + t) * s.h + set.h0;
    for (int64_t j = 0; j < set.hs; ++j)
#pragma omp simd
      for (int64_t k = 0; k < P; ++k) Xs[l * W + j * P + k] = dtr[j] * xr[j * P + k];
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

// Per-thread scratch: one chunk's blocks for a set of heads (W = hs p channels).
struct Scratch {
  Factors f;
  std::vector<float> decay, M, dM, Xs, dXs, G, Y, dS, dacum, dte, dD, dA, da;
  Scratch(const Dims& s, int64_t hs)
      : f(s.Q, hs), decay(s.Q * s.Q), M(s.Q * s.Q), dM(s.Q * s.Q), Xs(s.Q * hs * s.p), dXs(s.Q * hs * s.p),
        G(s.Q * hs * s.p), Y(s.Q * hs * s.p), dS(hs * s.p * s.n), dacum(hs * s.Q), dte(hs * s.Q), dD(hs * s.p),
        dA(hs), da(hs) {}
};

void forward_set(const In& in, const Dims& s, const HeadSet& set, const float* CB, float* y, float* states,
                 Scratch& w) {
  const int64_t Q = s.Q, P = s.p, N = s.n, W = set.hs * P, ldy = s.h * P, block = s.h * P * N;
  float* S = states + set.bi * (s.nc + 1) * block + set.h0 * P * N;  // chunk c's (W x N) block at S + c block
  if (in.h0) std::copy_n(in.h0 + (set.bi * s.h + set.h0) * P * N, W * N, S);
  else std::fill_n(S, W * N, 0.0f);
  Factors& f = w.f;
  for (int64_t c = 0; c < s.nc; ++c) {
    f.load(in, s, set, c);
    const int64_t Qc = f.Qc, t0 = f.t0;
    const float* cb = CB + ((set.bi * s.g + set.gi) * s.nc + c) * Q * Q;
    const float *Sc = S + c * block, *Bb = in.B + set.bi * in.sbb + t0 * in.sbt + set.gi * N,
                *Cb = in.C + set.bi * in.scb + t0 * in.sct + set.gi * N;
    scaled_inputs(in, s, set, f, w.Xs.data());
    float* yb = y + (set.bi * s.L + t0) * ldy + set.h0 * P;
    for (int64_t j = 0; j < set.hs; ++j) {  // the intra-chunk product, per head
      f.masked(j, cb, w.M.data(), nullptr);
      mm(false, false, Qc, P, Qc, w.M.data(), Q, w.Xs.data() + j * P, W, 0.0f, yb + j * P, ldy);
    }
    const bool read = c > 0 || in.h0;  // the entering state (zero in chunk 0 without h0)
    if (read) mm(false, true, Qc, W, N, Cb, in.sct, Sc, N, 0.0f, w.Y.data(), W);  // C S_c^T, every head
    for (int64_t l = 0; l < Qc; ++l) {
      float* __restrict__ yr = yb + l * ldy;
      const float* __restrict__ xr = in.x + set.bi * in.sxb + (t0 + l) * in.sxt + set.h0 * P;
      const float* __restrict__ Dr = in.D ? in.D + set.h0 * P : nullptr;
      for (int64_t j = 0; read && j < set.hs; ++j) {
        const float e = f.eA[j * Q + l];
        const float* __restrict__ yo = w.Y.data() + l * W + j * P;
#pragma omp simd
        for (int64_t k = 0; k < P; ++k) yr[j * P + k] += e * yo[k];
      }
      if (Dr) {
#pragma omp simd
        for (int64_t k = 0; k < W; ++k) yr[k] += Dr[k] * xr[k];
      }
    }
    float* Sn = S + (c + 1) * block;  // S_{c+1} = a S_c + (te * Xs)^T B
    for (int64_t j = 0; j < set.hs; ++j)
      for (int64_t i = j * P * N; i < (j + 1) * P * N; ++i) Sn[i] = f.a[j] * Sc[i];
    for (int64_t l = 0; l < Qc; ++l)
      for (int64_t j = 0; j < set.hs; ++j)
        for (int64_t k = 0; k < P; ++k) w.Xs[l * W + j * P + k] *= f.te[j * Q + l];
    mm(true, false, W, N, Qc, w.Xs.data(), W, Bb, in.sbt, 1.0f, Sn, N);
  }
}

// Gradient buffers: the heads' own (dx, ddt; dA, dD per (batch, head)), dh0, and the group's dB, dC and
// d(C B^T), which a set's heads accumulate into: each group's heads are split into `slots` sets, one task each,
// and every set accumulates into its own slot (b, L, g * slots, n) / (b, g * slots, nc, Q, Q), zeroed first.
// With one slot (enough tasks without splitting groups) dB and dC are accumulated in place.
struct Grads {
  const float* gy;
  int64_t sgb, sgt;
  const float* glast;
  float *dx, *ddt, *dA, *dD, *dh0, *dBp, *dCp, *dCBp;
  int64_t slots;
};

// The intra-chunk product's backward for head j (M = decay * C B^T in w.M, decays in w.decay): dXs = M^T dy;
// dM = dy Xs^T adds the head's part of d(C B^T) (dM * decay, lower triangle) and the decays' gradient goes
// into dacum (dM * M, strictly lower: + at l, - at s).
void intra_backward(const Dims& s, Scratch& w, int64_t j, int64_t W, const float* dy, int64_t ldy, float* dCB) {
  const int64_t Qc = w.f.Qc, Q = s.Q, P = s.p;
  mm(true, false, Qc, P, Qc, w.M.data(), Q, dy, ldy, 0.0f, w.dXs.data() + j * P, W);
  mm(false, true, Qc, Qc, P, dy, ldy, w.Xs.data() + j * P, W, 0.0f, w.dM.data(), Q);
  float* __restrict__ dacum = w.dacum.data() + j * Q;
  for (int64_t l = 0; l < Qc; ++l) {
    const float *__restrict__ dm = w.dM.data() + l * Q, *__restrict__ m = w.M.data() + l * Q,
                              *__restrict__ dc = w.decay.data() + l * Q;
    float* __restrict__ out = dCB + l * Q;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t s2 = 0; s2 < l; ++s2) {
      const float e = dm[s2] * m[s2];
      acc += e;
      dacum[s2] -= e;
      out[s2] += dm[s2] * dc[s2];
    }
    dacum[l] += acc;
    out[l] += dm[l];
  }
}

// The state write S_{c+1} += (te * Xs)^T B read through dS = dS_{c+1}, every head at once: G = B dS^T gives
// dXs += te G and dte = G . Xs per head; dB += (te * Xs) dS (the heads' sum inside the gemm); da = dS . S_c.
void state_write_backward(const In& in, const Dims& s, const HeadSet& set, Scratch& w, const float* Bb,
                          const float* Sc, float* dB, int64_t ldb) {
  const int64_t Qc = w.f.Qc, Q = s.Q, P = s.p, N = s.n, W = set.hs * P;
  mm(false, true, Qc, W, N, Bb, in.sbt, w.dS.data(), N, 0.0f, w.G.data(), W);
  for (int64_t l = 0; l < Qc; ++l)
    for (int64_t j = 0; j < set.hs; ++j) {
      float* __restrict__ g = w.G.data() + l * W + j * P;
      const float* __restrict__ xs = w.Xs.data() + l * W + j * P;
      float* __restrict__ dxs = w.dXs.data() + l * W + j * P;
      const float te = w.f.te[j * Q + l];
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < P; ++k) {
        acc += g[k] * xs[k];
        dxs[k] += te * g[k];
        g[k] = te * xs[k];  // G becomes te * Xs, the write's left factor
      }
      w.dte[j * Q + l] = acc;
    }
  mm(false, false, Qc, N, W, w.G.data(), W, w.dS.data(), N, 1.0f, dB, ldb);
  for (int64_t j = 0; j < set.hs; ++j) {
    const float *__restrict__ dS = w.dS.data() + j * P * N, *__restrict__ S = Sc + j * P * N;
    float da = 0.0f;
#pragma omp simd reduction(+ : da)
    for (int64_t i = 0; i < P * N; ++i) da += dS[i] * S[i];
    w.da[j] = da;
  }
}

// The read-out of the entering state, y += eA * (C S_c^T) per head: with Y = C S_c^T (every head, one gemm)
// d eA = dy . Y; Ey = eA * dy gives dC += Ey S_c (the heads' sum inside the gemm) and dS_c = a dS_{c+1} + Ey^T C.
void readout_backward(const In& in, const Dims& s, const HeadSet& set, Scratch& w, const float* dy, int64_t ldy,
                      const float* Cb, const float* Sc, float* dC, int64_t ldc, bool dS_zero) {
  const int64_t Qc = w.f.Qc, Q = s.Q, P = s.p, N = s.n, W = set.hs * P;
  mm(false, true, Qc, W, N, Cb, in.sct, Sc, N, 0.0f, w.Y.data(), W);
  for (int64_t l = 0; l < Qc; ++l)
    for (int64_t j = 0; j < set.hs; ++j) {
      const float e = w.f.eA[j * Q + l];
      const float* __restrict__ dyr = dy + l * ldy + j * P;
      float* __restrict__ yo = w.Y.data() + l * W + j * P;  // becomes Ey
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < P; ++k) {
        acc += dyr[k] * yo[k];
        yo[k] = e * dyr[k];
      }
      w.dacum[j * Q + l] += e * acc;
    }
  mm(false, false, Qc, N, W, w.Y.data(), W, Sc, N, 1.0f, dC, ldc);
  if (!dS_zero)
    for (int64_t j = 0; j < set.hs; ++j)
      for (int64_t i = j * P * N; i < (j + 1) * P * N; ++i) w.dS[i] *= w.f.a[j];
  mm(true, false, W, N, Qc, w.Y.data(), W, Cb, in.sct, dS_zero ? 0.0f : 1.0f, w.dS.data(), N);
}

// Per head: te's and a's gradients into dacum, dacum -> d(dt A) (a reverse cumsum in the chunk) -> ddt and dA;
// dx = dt dXs + D dy; dD.
void inputs_backward(const In& in, const Dims& s, const HeadSet& set, Scratch& w, const float* dy, int64_t ldy,
                     const Grads& gr) {
  const int64_t Qc = w.f.Qc, Q = s.Q, P = s.p, W = set.hs * P, t0 = w.f.t0;
  for (int64_t j = 0; j < set.hs; ++j) {
    const int64_t hh = set.h0 + j;
    float* dacum = w.dacum.data() + j * Q;
    for (int64_t l = 0; l < Qc; ++l) {  // te_l = exp(acum_last - acum_l)
      const float v = w.f.te[j * Q + l] * w.dte[j * Q + l];
      dacum[Qc - 1] += v;
      dacum[l] -= v;
    }
    dacum[Qc - 1] += w.f.a[j] * w.da[j];  // a = exp(acum_last)
    const float Ah = in.A[hh];
    const float* Dh = in.D ? in.D + hh * P : nullptr;
    float run = 0.0f;
    for (int64_t l = Qc - 1; l >= 0; --l) {
      run += dacum[l];
      const int64_t t = t0 + l;
      const float d = in.dt[(set.bi * s.L + t) * s.h + hh];
      const float *__restrict__ xr = in.x + set.bi * in.sxb + t * in.sxt + hh * P,
                                *__restrict__ dxs = w.dXs.data() + l * W + j * P, *__restrict__ dyr = dy + l * ldy + j * P;
      float* __restrict__ dxr = gr.dx + ((set.bi * s.L + t) * s.h + hh) * P;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < P; ++k) {
        acc += dxs[k] * xr[k];
        dxr[k] = d * dxs[k] + (Dh ? Dh[k] * dyr[k] : 0.0f);
      }
      if (Dh)
        for (int64_t k = 0; k < P; ++k) w.dD[j * P + k] += dyr[k] * xr[k];
      gr.ddt[(set.bi * s.L + t) * s.h + hh] = Ah * run + acc;
      w.dA[j] += d * run;
    }
  }
}

void backward_set(const In& in, const Dims& s, const HeadSet& set, int64_t slot, const float* CB,
                  const float* states, bool has_h0, const Grads& gr, Scratch& w) {
  const int64_t Q = s.Q, P = s.p, N = s.n, W = set.hs * P, block = s.h * P * N;
  const int64_t ldp = s.g * gr.slots * N, sl = set.gi * gr.slots + slot;  // the set's slot in a batch row
  const float* S = states + set.bi * (s.nc + 1) * block + set.h0 * P * N;
  bool dS_zero = gr.glast == nullptr;
  if (!dS_zero) std::copy_n(gr.glast + (set.bi * s.h + set.h0) * P * N, W * N, w.dS.data());
  std::fill(w.dD.begin(), w.dD.end(), 0.0f);
  std::fill(w.dA.begin(), w.dA.end(), 0.0f);
  Factors& f = w.f;
  for (int64_t c = s.nc - 1; c >= 0; --c) {
    f.load(in, s, set, c);
    const int64_t Qc = f.Qc, t0 = f.t0;
    const float* cb = CB + ((set.bi * s.g + set.gi) * s.nc + c) * Q * Q;
    const float* dy = gr.gy + set.bi * gr.sgb + t0 * gr.sgt + set.h0 * P;
    const float *Sc = S + c * block, *Bb = in.B + set.bi * in.sbb + t0 * in.sbt + set.gi * N,
                *Cb = in.C + set.bi * in.scb + t0 * in.sct + set.gi * N;
    scaled_inputs(in, s, set, f, w.Xs.data());
    std::fill_n(w.dacum.begin(), set.hs * Q, 0.0f);
    std::fill_n(w.dte.begin(), set.hs * Q, 0.0f);
    std::fill_n(w.da.begin(), set.hs, 0.0f);
    float* dCB = gr.dCBp + ((set.bi * s.g * gr.slots + sl) * s.nc + c) * Q * Q;
    for (int64_t j = 0; j < set.hs; ++j) {
      f.masked(j, cb, w.M.data(), w.decay.data());
      intra_backward(s, w, j, W, dy + j * P, gr.sgt, dCB);
    }
    if (!dS_zero) state_write_backward(in, s, set, w, Bb, Sc, gr.dBp + (set.bi * s.L + t0) * ldp + sl * N, ldp);
    if (c > 0 || has_h0) {
      readout_backward(in, s, set, w, dy, gr.sgt, Cb, Sc, gr.dCp + (set.bi * s.L + t0) * ldp + sl * N, ldp,
                       dS_zero);
      dS_zero = false;
    }
    inputs_backward(in, s, set, w, dy, gr.sgt, gr);
  }
  for (int64_t j = 0; j < set.hs; ++j) gr.dA[set.bi * s.h + set.h0 + j] = w.dA[j];
  if (gr.dD) std::copy(w.dD.begin(), w.dD.end(), gr.dD + (set.bi * s.h + set.h0) * P);
  if (gr.dh0) {
    float* out = gr.dh0 + (set.bi * s.h + set.h0) * P * N;
    if (dS_zero) std::fill_n(out, W * N, 0.0f);
    else std::copy_n(w.dS.data(), W * N, out);
  }
}

// dB, dC (b, L, g, n): the group's slots summed (nothing to sum with one slot: the sets accumulated in place),
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

}  // namespace

// Returns y (b, L, h, p), the states entering every chunk and the final one (b, nc + 1, h, p, n) and C B^T per
// chunk (b, g, nc, Q, Q): the last two are what the backward reads.
std::vector<torch::Tensor> ssd_forward(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                       torch::Tensor C, torch::Tensor starts, torch::Tensor D, torch::Tensor h0,
                                       int64_t chunk, int64_t threads) {
  const Dims s = dims_of(x, B, chunk);
  const In in(x, dt, A, B, C, starts, D, h0);
  auto y = torch::empty({s.b, s.L, s.h, s.p}, x.options());
  auto states = torch::empty({s.b, s.nc + 1, s.h, s.p, s.n}, x.options());
  auto CB = torch::empty({s.b, s.g, s.nc, s.Q, s.Q}, x.options());
  chunk_products(in, s, CB.data_ptr<float>(), static_cast<int>(threads));
  float *py = y.data_ptr<float>(), *pst = states.data_ptr<float>();
  const float* pcb = CB.data_ptr<float>();
  const int64_t slots = slots_for(s, std::max<int64_t>(threads, 1));
  parallel_channels(s.b * s.g * slots, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    Scratch w(s, s.h / s.g / slots);
    for (int64_t task = begin; task < end; ++task) forward_set(in, s, head_set(s, slots, task), pcb, py, pst, w);
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
  const int64_t slots = slots_for(s, std::max<int64_t>(threads, 1));
  auto dx = torch::empty({s.b, s.L, s.h, s.p}, f), ddt = torch::empty({s.b, s.L, s.h}, f);
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
    Scratch w(s, s.h / s.g / slots);
    for (int64_t task = begin; task < end; ++task)
      backward_set(in, s, head_set(s, slots, task), task % slots, pcb, pst, has_h0, gr, w);
  });
  group_backward(in, s, gr, dB.data_ptr<float>(), dC.data_ptr<float>(), static_cast<int>(threads));
  return {dx, ddt, dA, dB, dC, dD, dh0};
}
