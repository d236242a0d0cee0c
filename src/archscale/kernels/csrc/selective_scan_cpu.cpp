// Mamba-1 selective scan on CPU: one fused pass per channel, forward and backward (and, at the end of this
// file, the mixers' causal depthwise conv + silu: the scan's input, and Mamba-2's and Gated DeltaNet's; and their
// gated RMSNorm).
//
// The pure-PyTorch chunked scan (selective_scan.py) materialises (steps, batch, d_inner, d_state) tensors and
// makes ~30 passes over them per layer and step: on CPU it is memory-bound. Here each (batch, channel) pair runs
// its recurrence with the d_state-long state in registers, reading only the (batch, channel, time) and
// (batch, time, d_state) inputs; nothing of size time x d_state x d_inner is ever written. The elementwise
// tail of the scan (the D skip, the silu(z) gate) is fused in, so the Mamba layer makes no extra passes after
// it (dt's bias and softplus stay in torch, whose vectorised softplus is faster than a scalar one here).
// Backward recomputes the states of one block (BLOCK steps) at a time from the state saved at the block start,
// then runs the adjoint recurrence in reverse. Each channel's loops are a template on d_state: compiled for 16
// (Mamba's), the state and A stay in registers across steps (~30% faster than a runtime bound); any other
// d_state up to MAX_STATE runs the same code with a runtime bound. Semantics are those of
// `selective_scan(..., impl="ref")` (the test oracle):
//     a_t = exp(dt_t * A) * keep_t;  h_t = a_t h_{t-1} + dt_t u_t B_t
//     y_t = (C_t . h_t + D u_t) * silu(z_t)
// Layouts, fp32: u, dt, z, gy: (b, d, L) with any strides (the Mamba layer passes transposed views of
// (b, L, d) storage; they are gathered into contiguous rows TILE channels at a time, see gather());
// A (d, n); Bt, Ct (b, L, n) contiguous; h0 (b, d, n); keep (b, L) or empty; D (d) or empty; z may be
// empty. y is written (b, L, d)-contiguous: what out_proj reads.

#include <torch/extension.h>

#include "cpu_common.h"
#include "cross_entropy_cpu.h"
#include "gated_delta_cpu.h"
#include "ssd_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using archscale_cpu::fast_exp;
using archscale_cpu::parallel_channels;

// How many per-thread partial-sum slots a parallel_channels call may touch.
int64_t slots(int64_t threads) { return std::max<int64_t>({1, threads, at::get_num_threads()}); }

// A (b, d, L) tensor with arbitrary strides, read per element.
struct View {
  const float* p;
  int64_t sb, sd, st;
  View(const torch::Tensor& x)
      : p(x.numel() ? x.data_ptr<float>() : nullptr), sb(x.dim() == 3 ? x.stride(0) : 0),
        sd(x.dim() == 3 ? x.stride(1) : 0), st(x.dim() == 3 ? x.stride(2) : 0) {}
  float at(int64_t b, int64_t d, int64_t t) const { return p[b * sb + d * sd + t * st]; }
};

constexpr int64_t MAX_STATE = 256;  // d_state bound of the stack buffers (scan_cpu.MAX_STATE in Python)

struct Dims {
  int64_t b, d, L, n, block, nblocks;
};

Dims dims_of(const torch::Tensor& u, const torch::Tensor& A, int64_t block) {
  Dims s{u.size(0), u.size(1), u.size(2), A.size(1), block, 0};
  TORCH_CHECK(s.n <= MAX_STATE, "selective_scan_cpu: d_state must be at most ", MAX_STATE, " (got ", s.n, ")");
  s.nblocks = (s.L + block - 1) / block;
  return s;
}

// 0 / 1 at the clamps, as expf; always inlined, as fast_exp (cpu_common.h)
inline __attribute__((always_inline)) float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }
// d silu(x) / dx, given sg = sigmoid(x): the gate's backward in the scan and the conv's
inline float dsilu(float x, float sg) { return sg * (1.0f + x * (1.0f - sg)); }

// The inputs every channel reads, and the optional tail.
struct Inputs {
  View u, dt, z;
  const float *A, *Bt, *Ct, *h0, *keep, *D;
  Inputs(const torch::Tensor& u_, const torch::Tensor& dt_, const torch::Tensor& A_, const torch::Tensor& Bt_,
         const torch::Tensor& Ct_, const torch::Tensor& h0_, const torch::Tensor& keep_, const torch::Tensor& D_,
         const torch::Tensor& z_)
      : u(u_), dt(dt_), z(z_), A(A_.data_ptr<float>()), Bt(Bt_.data_ptr<float>()), Ct(Ct_.data_ptr<float>()),
        h0(h0_.numel() ? h0_.data_ptr<float>() : nullptr), keep(keep_.numel() ? keep_.data_ptr<float>() : nullptr),
        D(D_.numel() ? D_.data_ptr<float>() : nullptr) {}
};

// Channels are processed TILE at a time: their (b, d, L) inputs are gathered into contiguous rows and their
// outputs scattered back, a time step at a time over the tile's channels. The Mamba layer's tensors are (b, L, d)
// storage, where one channel's steps lie a row (d floats) apart: read per channel, every step is a new cache
// line and often a new page; per tile, TILE neighbouring channels share each line.
constexpr int64_t TILE = 16;

// rows[c * L + t] = v(bi, c0 + c, t) for c < nc
void gather(const View& v, int64_t bi, int64_t c0, int64_t nc, int64_t L, float* rows) {
  for (int64_t t = 0; t < L; ++t)
    for (int64_t c = 0; c < nc; ++c) rows[c * L + t] = v.at(bi, c0 + c, t);
}

// out[(bi * L + t) * d + c0 + c] = rows[c * L + t] for c < nc: out is (b, L, d) contiguous
void scatter(const float* rows, int64_t bi, int64_t c0, int64_t nc, int64_t L, int64_t d, float* out) {
  for (int64_t t = 0; t < L; ++t)
    for (int64_t c = 0; c < nc; ++c) out[(bi * L + t) * d + c0 + c] = rows[c * L + t];
}

// One (batch, channel) recurrence of the forward, on gathered rows (zr null without the gate); writes yrow, the
// last state and the block-start states. N > 0: d_state known at compile time; N == 0: runtime d_state.
template <int64_t N>
void forward_channel(const Inputs& in, const Dims& s, int64_t bi, int64_t di, const float* __restrict__ dtr,
                     const float* __restrict__ ur, const float* __restrict__ zr, float* __restrict__ yrow,
                     float* __restrict__ plast, float* __restrict__ pst) {
  const int64_t n = N ? N : s.n;
  const int64_t ch = bi * s.d + di;
  alignas(64) float h[N ? N : MAX_STATE];
  alignas(64) float Ad[N ? N : MAX_STATE];
  for (int64_t j = 0; j < n; ++j) Ad[j] = in.A[di * n + j];
  const float Dd = in.D ? in.D[di] : 0.0f;
  for (int64_t j = 0; j < n; ++j) h[j] = in.h0 ? in.h0[ch * n + j] : 0.0f;
  for (int64_t t0 = 0; t0 < s.L; t0 += s.block) {
    std::copy(h, h + n, pst + (ch * s.nblocks + t0 / s.block) * n);
    const int64_t t1 = std::min(s.L, t0 + s.block);
    for (int64_t t = t0; t < t1; ++t) {
      const float dtv = dtr[t], uv = ur[t], x = dtv * uv;
      const float kv = in.keep ? in.keep[bi * s.L + t] : 1.0f;
      const float* __restrict__ Bl = in.Bt + (bi * s.L + t) * n;
      const float* __restrict__ Cl = in.Ct + (bi * s.L + t) * n;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < n; ++j) {
        h[j] = fast_exp(dtv * Ad[j]) * kv * h[j] + x * Bl[j];
        acc += h[j] * Cl[j];
      }
      yrow[t] = acc + Dd * uv;
    }
  }
  if (zr) {  // the gate, in its own loop over time so sigmoid vectorises
#pragma omp simd
    for (int64_t t = 0; t < s.L; ++t) yrow[t] *= zr[t] * sigmoid(zr[t]);
  }
  std::copy(h, h + n, plast + ch * n);
}

// Where the backward writes: per-thread partial sums (gA, gD, gB, gC) and gh0; and its inputs glast and the
// saved block-start states.
struct Grads {
  float *gh0, *gA, *gD, *gB, *gC;
  const float *glast, *starts;
};

// One channel's rows in the backward: inputs dt, u, z (null without the gate), gy; outputs gu, gdt, gz.
struct Rows {
  const float *dt, *u, *z, *gy;
  float *gu, *gdt, *gz;
};

// One thread's scratch: recomputed states and decays of a block, the block's pre-gate output and dLoss/d(pre).
struct Workspace {
  std::vector<float> hs, as, pre, gyrow;
};

// One (batch, channel) of the backward: per block from the last, recompute its states from the saved start,
// then run the adjoint recurrence in reverse. N as in forward_channel.
template <int64_t N>
void backward_channel(const Inputs& in, const Dims& s, int64_t bi, int64_t di, int th, const Rows& r,
                      const Grads& o, Workspace& w) {
  const int64_t n = N ? N : s.n;
  const int64_t ch = bi * s.d + di;
  alignas(64) float G[N ? N : MAX_STATE], Ad[N ? N : MAX_STATE], gAd[N ? N : MAX_STATE];
  for (int64_t j = 0; j < n; ++j) {
    Ad[j] = in.A[di * n + j];
    G[j] = o.glast[ch * n + j];
    gAd[j] = 0.0f;
  }
  const float Dd = in.D ? in.D[di] : 0.0f;
  float gDd = 0.0f;
  const float* __restrict__ dtr = r.dt;
  const float* __restrict__ ur = r.u;
  float *gBt = o.gB + th * s.b * s.L * n, *gCt = o.gC + th * s.b * s.L * n;
  for (int64_t blk = s.nblocks - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * s.block, t1 = std::min(s.L, t0 + s.block);
    float* __restrict__ hs = w.hs.data();  // hs[i]: the state before step t0 + i (hs[0] = the saved start)
    float* __restrict__ as = w.as.data();
    float* __restrict__ pre = w.pre.data();
    float* __restrict__ gr = w.gyrow.data();
    std::copy(o.starts + (ch * s.nblocks + blk) * n, o.starts + (ch * s.nblocks + blk + 1) * n, hs);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t - t0;
      const float dtv = dtr[t], x = dtv * ur[t];
      const float kv = in.keep ? in.keep[bi * s.L + t] : 1.0f;
      const float* __restrict__ Bl = in.Bt + (bi * s.L + t) * n;
      const float* __restrict__ Cl = in.Ct + (bi * s.L + t) * n;
      const float* __restrict__ hp = hs + i * n;
      float* __restrict__ hn = hs + (i + 1) * n;
      float* __restrict__ ap = as + i * n;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < n; ++j) {
        ap[j] = fast_exp(dtv * Ad[j]) * kv;
        hn[j] = ap[j] * hp[j] + x * Bl[j];
        acc += hn[j] * Cl[j];
      }
      pre[i] = acc + Dd * ur[t];
    }
    if (r.z) {  // through the gate y = pre * silu(z), vectorised over the block's steps
#pragma omp simd
      for (int64_t i = 0; i < t1 - t0; ++i) {
        const float zv = r.z[t0 + i], sg = sigmoid(zv), g = r.gy[t0 + i];
        r.gz[t0 + i] = g * pre[i] * dsilu(zv, sg);
        gr[i] = g * zv * sg;
      }
    } else {
      for (int64_t i = 0; i < t1 - t0; ++i) gr[i] = r.gy[t0 + i];
    }
    // adjoint: G = dLoss/dh_t, carried backwards through a_t
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const int64_t i = t - t0;
      const float dtv = dtr[t], uv = ur[t], x = dtv * uv;
      const int64_t row = (bi * s.L + t) * n;
      const float* __restrict__ Bl = in.Bt + row;
      const float* __restrict__ Cl = in.Ct + row;
      const float* __restrict__ hprev = hs + i * n;
      const float* __restrict__ hcur = hs + (i + 1) * n;
      const float* __restrict__ ap = as + i * n;
      float* __restrict__ gBl = gBt + row;
      float* __restrict__ gCl = gCt + row;
      const float gyv_t = gr[i];
      gDd += gyv_t * uv;
      float gx = 0.0f, gdt_a = 0.0f;
#pragma omp simd reduction(+ : gx, gdt_a)
      for (int64_t j = 0; j < n; ++j) {
        const float g = G[j] + gyv_t * Cl[j];
        gCl[j] += gyv_t * hcur[j];
        gx += g * Bl[j];
        gBl[j] += g * x;
        const float glog = g * ap[j] * hprev[j];  // dLoss/d(dt*A) at (t, j)
        gdt_a += glog * Ad[j];
        gAd[j] += glog * dtv;
        G[j] = g * ap[j];
      }
      r.gu[t] = gx * dtv + gyv_t * Dd;
      r.gdt[t] = gx * uv + gdt_a;
    }
  }
  float* gAt = o.gA + (th * s.d + di) * n;
  for (int64_t j = 0; j < n; ++j) gAt[j] += gAd[j];
  o.gD[th * s.d + di] += gDd;
  std::copy(G, G + n, o.gh0 + ch * n);
}

}  // namespace

// Returns y (b, L, d), the last state (b, d, n) and the state entering every block (b, d, nblocks, n).
std::vector<torch::Tensor> scan_forward(torch::Tensor u, torch::Tensor dt, torch::Tensor A, torch::Tensor Bt,
                                        torch::Tensor Ct, torch::Tensor h0, torch::Tensor keep, torch::Tensor D,
                                        torch::Tensor z, int64_t block, int64_t threads) {
  const Dims s = dims_of(u, A, block);
  const Inputs in(u, dt, A, Bt, Ct, h0, keep, D, z);
  auto y = torch::empty({s.b, s.L, s.d}, u.options());
  auto last = torch::empty({s.b, s.d, s.n}, u.options());
  auto starts = torch::empty({s.b, s.d, s.nblocks, s.n}, u.options());
  float *py = y.data_ptr<float>(), *plast = last.data_ptr<float>(), *pst = starts.data_ptr<float>();
  const int64_t tiles = (s.d + TILE - 1) / TILE;
  parallel_channels(s.b * tiles, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    std::vector<float> dtT(TILE * s.L), uT(TILE * s.L), zT(in.z.p ? TILE * s.L : 0), yT(TILE * s.L);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t bi = tile / tiles, c0 = (tile % tiles) * TILE, nc = std::min(TILE, s.d - c0);
      gather(in.dt, bi, c0, nc, s.L, dtT.data());
      gather(in.u, bi, c0, nc, s.L, uT.data());
      if (in.z.p) gather(in.z, bi, c0, nc, s.L, zT.data());
      for (int64_t c = 0; c < nc; ++c) {
        const float* zr = in.z.p ? zT.data() + c * s.L : nullptr;
        float *dtr = dtT.data() + c * s.L, *ur = uT.data() + c * s.L, *yr = yT.data() + c * s.L;
        if (s.n == 16) forward_channel<16>(in, s, bi, c0 + c, dtr, ur, zr, yr, plast, pst);
        else forward_channel<0>(in, s, bi, c0 + c, dtr, ur, zr, yr, plast, pst);
      }
      scatter(yT.data(), bi, c0, nc, s.L, s.d, py);
    }
  });
  return {y, last, starts};
}

// Gradients (gu, gdt (b, L, d), gA, gB, gC (b, L, n), gh0, gD, gz (b, L, d)) from gy (b, d, L, any strides)
// and glast (b, d, n). Absent inputs get empty gradients. gu and gdt are written (b, L, d) because in the Mamba
// layer u (the conv's output) and dt (dt_proj's) are (b, L, d) storage: the backward passes before them (the
// conv's, softplus's, dt_proj's) then read them in that layout, with no strided pass or copy.
std::vector<torch::Tensor> scan_backward(torch::Tensor gy, torch::Tensor glast, torch::Tensor u, torch::Tensor dt,
                                         torch::Tensor A, torch::Tensor Bt, torch::Tensor Ct, torch::Tensor keep,
                                         torch::Tensor D, torch::Tensor z, torch::Tensor starts, int64_t block,
                                         int64_t threads) {
  const Dims s = dims_of(u, A, block);
  const Inputs in(u, dt, A, Bt, Ct, torch::empty({0}, u.options()), keep, D, z);
  const View gyv(gy);
  const int64_t tiles = (s.d + TILE - 1) / TILE;
  auto opts = u.options();
  auto gu = torch::empty({s.b, s.L, s.d}, opts), gdt = torch::empty({s.b, s.L, s.d}, opts);
  auto gh0 = torch::empty({s.b, s.d, s.n}, opts);
  auto gz = z.numel() ? torch::empty({s.b, s.L, s.d}, opts) : torch::empty({0}, opts);
  // per-thread partial sums of the gradients that reduce over channels or batch, summed at the end
  const int64_t nslot = slots(threads);
  auto gA_part = torch::zeros({nslot, s.d, s.n}, opts);
  auto gD_part = torch::zeros({nslot, s.d}, opts);
  auto gB_part = torch::zeros({nslot, s.b, s.L, s.n}, opts);
  auto gC_part = torch::zeros({nslot, s.b, s.L, s.n}, opts);
  const Grads out{gh0.data_ptr<float>(), gA_part.data_ptr<float>(), gD_part.data_ptr<float>(),
                  gB_part.data_ptr<float>(), gC_part.data_ptr<float>(), glast.data_ptr<float>(),
                  starts.data_ptr<float>()};
  float *pgu = gu.data_ptr<float>(), *pgd = gdt.data_ptr<float>();
  float* pgz = gz.numel() ? gz.data_ptr<float>() : nullptr;
  parallel_channels(s.b * tiles, static_cast<int>(threads), [&](int th, int64_t begin, int64_t end) {
    Workspace w{std::vector<float>((s.block + 1) * s.n), std::vector<float>(s.block * s.n),
                std::vector<float>(s.block), std::vector<float>(s.block)};
    const int64_t zl = in.z.p ? TILE * s.L : 0;
    std::vector<float> dtT(TILE * s.L), uT(TILE * s.L), zT(zl), gyT(TILE * s.L);
    std::vector<float> guT(TILE * s.L), gdtT(TILE * s.L), gzT(zl);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t bi = tile / tiles, c0 = (tile % tiles) * TILE, nc = std::min(TILE, s.d - c0);
      gather(in.dt, bi, c0, nc, s.L, dtT.data());
      gather(in.u, bi, c0, nc, s.L, uT.data());
      gather(gyv, bi, c0, nc, s.L, gyT.data());
      if (in.z.p) gather(in.z, bi, c0, nc, s.L, zT.data());
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t o = c * s.L;
        const Rows r{dtT.data() + o, uT.data() + o, in.z.p ? zT.data() + o : nullptr, gyT.data() + o,
                     guT.data() + o, gdtT.data() + o, in.z.p ? gzT.data() + o : nullptr};
        if (s.n == 16) backward_channel<16>(in, s, bi, c0 + c, th, r, out, w);
        else backward_channel<0>(in, s, bi, c0 + c, th, r, out, w);
      }
      scatter(guT.data(), bi, c0, nc, s.L, s.d, pgu);
      scatter(gdtT.data(), bi, c0, nc, s.L, s.d, pgd);
      if (in.z.p) scatter(gzT.data(), bi, c0, nc, s.L, s.d, pgz);
    }
  });
  return {gu, gdt, gA_part.sum(0), gB_part.sum(0), gC_part.sum(0), gh0, gD_part.sum(0), gz};
}

// ------------------------------------------------------------------------------------------------------------
// The mixers' causal depthwise conv and the silu after it, fused, over (b, P + L, d) rows:
//     pre[b, t, c] = bias[c] + sum_{j=0}^{K-1} w[K-1-j, c] x[b, P + t - j, c]     (taps j steps back)
//     out          = silu(pre) (or pre itself, silu = false)
// The first P rows of x (0 <= P < K) are history (a decoding state's tail): outputs are for the L rows after
// them; a tap before row 0 reads 0. `back` (b, L) int32, when given, bounds the taps of each output (its
// position in its document, at most K-1): taps reaching into an earlier document read 0 (packed training).
// x: unit channel stride, any batch / time strides (Mamba's is a view into in_proj's output); wT (K, d)
// contiguous; bias (d) or empty. out is (b, L, d) contiguous. torch's depthwise conv wants (b, d, L)
// contiguous input, and its weight backward ran single-threaded here.

namespace {

struct ConvDims {
  int64_t b, L, d, K, P, sb, st;
  const int32_t* back;  // (b, L) or nullptr
  ConvDims(const torch::Tensor& x, const torch::Tensor& wT, int64_t prefix, const torch::Tensor& back_)
      : b(x.size(0)), L(x.size(1) - prefix), d(x.size(2)), K(wT.size(0)), P(prefix), sb(x.stride(0)),
        st(x.stride(1)), back(back_.numel() ? back_.data_ptr<int32_t>() : nullptr) {
    TORCH_CHECK(x.stride(2) == 1, "conv_silu: x needs unit channel stride");
    TORCH_CHECK(prefix >= 0 && prefix < K && L >= 0, "conv_silu: prefix must be in [0, K) and at most x's steps");
    TORCH_CHECK(!back || back_.size(0) == b && back_.size(1) == L, "conv_silu: back must be (b, L)");
  }
  // the most taps back output row (bi, t) may use
  int64_t reach(int64_t bi, int64_t t) const {
    const int64_t r = std::min<int64_t>(K - 1, P + t);
    return back ? std::min<int64_t>(r, back[bi * L + t]) : r;
  }
  const float* row(const float* x, int64_t bi, int64_t xt) const { return x + bi * sb + xt * st; }
  // K = 4 and output rows t..t+3 all reach their four taps (and are rows of this batch row)
  bool full_block4(int64_t bi, int64_t t) const {
    if (K != 4 || t + 4 > L) return false;
    for (int64_t i = 0; i < 4; ++i)
      if (reach(bi, t + i) != 3) return false;
    return true;
  }
};

// pre-activation of output row (bi, t) into pre[0..d)
inline void conv_row(const ConvDims& s, const float* x, const float* w, const float* bias, int64_t bi, int64_t t,
                     float* __restrict__ pre) {
  for (int64_t c = 0; c < s.d; ++c) pre[c] = bias ? bias[c] : 0.0f;
  for (int64_t j = 0; j <= s.reach(bi, t); ++j) {
    const float* __restrict__ xr = s.row(x, bi, s.P + t - j);
    const float* __restrict__ wk = w + (s.K - 1 - j) * s.d;
#pragma omp simd
    for (int64_t c = 0; c < s.d; ++c) pre[c] += wk[c] * xr[c];
  }
}

// K = 4 (every mixer's default) with all four taps in reach: the rows' taps in one pass over the channels, the
// activation (forward) or its gradient and the weight gradients (backward) in the same pass. The general loops
// above pass over the output row once per tap (4 reads and writes of it); these read each input once. Where
// four neighbouring rows all qualify, the *_block4 loops below take them together: 7 input rows read for 4
// outputs, not 16, and the weight gradients read and written once per 4 rows. At (4, 512, 2048) on a 2-core
// Xeon that took the forward from 1.73 to 1.40 ms and the backward from ~4.2 to ~2.8 ms (medians, A/B pairs).
// The backward then works in tiles of CONV_TILE rows: gpre never becomes a whole (b, L, d) tensor, written and
// read back (medians ~2.8 -> 2.5-2.7 ms there; one allocation fewer), at the price of K - 1 rows made twice a tile.
constexpr int64_t K4 = 4;

// the taps' rows, newest first: x[j] is the input j steps back from output (bi, t)
struct Taps4 {
  const float* x[K4];
  Taps4(const ConvDims& s, const float* px, int64_t bi, int64_t t) {
    for (int64_t j = 0; j < K4; ++j) x[j] = s.row(px, bi, s.P + t - j);
  }
};

template <bool SILU, bool BIAS>
void conv_row4(const Taps4& tp, const float* w, const float* bias, int64_t d, float* __restrict__ out) {
  const float *x0 = tp.x[0], *x1 = tp.x[1], *x2 = tp.x[2], *x3 = tp.x[3];
  const float *w0 = w + 3 * d, *w1 = w + 2 * d, *w2 = w + d, *w3 = w;  // tap j's weight is wT[K-1-j]
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) out[c] = w0[c] * x0[c] + w1[c] * x1[c] + w2[c] * x2[c] + w3[c] * x3[c];
  if (BIAS) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] += bias[c];
  }
  if (SILU) {  // its own pass over the row (still in L1), as in the general path
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] *= sigmoid(out[c]);
  }
}

// gpre = g * silu'(pre) into gp, and the row's part of the weight (K rows, then the bias) gradients into gw
template <bool SILU, bool BIAS>
void conv_row4_backward(const Taps4& tp, const float* w, const float* bias, const float* g, int64_t d,
                        float* __restrict__ gp, float* __restrict__ gw) {
  const float *x0 = tp.x[0], *x1 = tp.x[1], *x2 = tp.x[2], *x3 = tp.x[3];
  const float *w0 = w + 3 * d, *w1 = w + 2 * d, *w2 = w + d, *w3 = w;
  float *gw0 = gw + 3 * d, *gw1 = gw + 2 * d, *gw2 = gw + d, *gw3 = gw, *gb = gw + K4 * d;
  if (SILU) {  // the pre-activation again, then its gradient in place
    conv_row4<false, BIAS>(tp, w, bias, d, gp);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) gp[c] = g[c] * dsilu(gp[c], sigmoid(gp[c]));
  } else {
    std::copy(g, g + d, gp);
  }
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) {
    const float q = gp[c];
    gw0[c] += q * x0[c];
    gw1[c] += q * x1[c];
    gw2[c] += q * x2[c];
    gw3[c] += q * x3[c];
    if (BIAS) gb[c] += q;
  }
}

// Four output rows t..t+3 at once, all taps of all four in reach (x[i] is input row t - 3 + i, i = 0..6; g[r],
// gp[r] rows t + r): each weight gradient is read and written once per four rows, where row by row it was
// read and written once per row (five read-modify-write streams per row: most of this pass's time).
template <bool SILU, bool BIAS>
void conv_block4_backward(const float* const* x, const float* const* g, float* const* gp, const float* w,
                          const float* bias, int64_t d, float* __restrict__ gw) {
  const float *w0 = w + 3 * d, *w1 = w + 2 * d, *w2 = w + d, *w3 = w;
  float *gw0 = gw + 3 * d, *gw1 = gw + 2 * d, *gw2 = gw + d, *gw3 = gw, *gb = gw + K4 * d;
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5], *x6 = x[6];
  const float *g0 = g[0], *g1 = g[1], *g2 = g[2], *g3 = g[3];
  float *p0 = gp[0], *p1 = gp[1], *p2 = gp[2], *p3 = gp[3];
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) {
    const float xs[7] = {x0[c], x1[c], x2[c], x3[c], x4[c], x5[c], x6[c]};
    const float gs[4] = {g0[c], g1[c], g2[c], g3[c]};
    float q[4];
    for (int r = 0; r < 4; ++r) {  // output row t + r: taps j = 0..3 read xs[3 + r - j]
      const float pre = w0[c] * xs[3 + r] + w1[c] * xs[2 + r] + w2[c] * xs[1 + r] + w3[c] * xs[r] +
                        (BIAS ? bias[c] : 0.0f);
      q[r] = SILU ? gs[r] * dsilu(pre, sigmoid(pre)) : gs[r];
    }
    p0[c] = q[0];
    p1[c] = q[1];
    p2[c] = q[2];
    p3[c] = q[3];
    gw0[c] += q[0] * xs[3] + q[1] * xs[4] + q[2] * xs[5] + q[3] * xs[6];
    gw1[c] += q[0] * xs[2] + q[1] * xs[3] + q[2] * xs[4] + q[3] * xs[5];
    gw2[c] += q[0] * xs[1] + q[1] * xs[2] + q[2] * xs[3] + q[3] * xs[4];
    gw3[c] += q[0] * xs[0] + q[1] * xs[1] + q[2] * xs[2] + q[3] * xs[3];
    if (BIAS) gb[c] += q[0] + q[1] + q[2] + q[3];
  }
}

// output rows t..t+3 at once, all their taps in reach (x[i] = input row t - 3 + i, i = 0..6; out rows ldo apart)
template <bool SILU, bool BIAS>
void conv_block4(const float* const* x, const float* w, const float* bias, int64_t d, float* __restrict__ out,
                 int64_t ldo) {
  const float *w0 = w + 3 * d, *w1 = w + 2 * d, *w2 = w + d, *w3 = w;
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5], *x6 = x[6];
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) {
    const float xs[7] = {x0[c], x1[c], x2[c], x3[c], x4[c], x5[c], x6[c]};
    for (int r = 0; r < 4; ++r) {
      const float pre = w0[c] * xs[3 + r] + w1[c] * xs[2 + r] + w2[c] * xs[1 + r] + w3[c] * xs[r] +
                        (BIAS ? bias[c] : 0.0f);
      out[r * ldo + c] = SILU ? pre * sigmoid(pre) : pre;
    }
  }
}

// one forward row (bi, t): the fused pass when it applies, else the general one
inline void conv_out_row(const ConvDims& s, const float* px, const float* pw, const float* pb, bool silu,
                         int64_t bi, int64_t t, float* o) {
  if (s.K == K4 && s.reach(bi, t) == K4 - 1) {
    const Taps4 tp(s, px, bi, t);
    if (silu) pb ? conv_row4<true, true>(tp, pw, pb, s.d, o) : conv_row4<true, false>(tp, pw, pb, s.d, o);
    else pb ? conv_row4<false, true>(tp, pw, pb, s.d, o) : conv_row4<false, false>(tp, pw, pb, s.d, o);
    return;
  }
  conv_row(s, px, pw, pb, bi, t, o);
  if (!silu) return;
#pragma omp simd
  for (int64_t c = 0; c < s.d; ++c) o[c] *= sigmoid(o[c]);
}

// input row xt's gradient: gx[xt] = sum_j w[K-1-j] gpre[xt - P + j], over the outputs that reach it (one pass
// when all K = 4 of them do)
// whether all K = 4 outputs that read input row xt reach it
inline bool read_by_all4(const ConvDims& s, int64_t bi, int64_t xt) {
  const int64_t t0 = xt - s.P;
  bool all = s.K == K4 && t0 >= 0 && t0 + K4 - 1 < s.L;
  for (int64_t j = 0; all && j < K4; ++j) all = s.reach(bi, t0 + j) >= j;
  return all;
}

// input rows xt..xt+3's gradients at once, all read by all four outputs (g[i] = gpre row xt - P + i, i = 0..6)
inline void conv_in_grad_block4(const float* const* g, const float* pw, int64_t d, float* __restrict__ o,
                                int64_t ldo) {
  const float *w0 = pw + 3 * d, *w1 = pw + 2 * d, *w2 = pw + d, *w3 = pw;
  const float *g0 = g[0], *g1 = g[1], *g2 = g[2], *g3 = g[3], *g4 = g[4], *g5 = g[5], *g6 = g[6];
  float *o0 = o, *o1 = o + ldo, *o2 = o + 2 * ldo, *o3 = o + 3 * ldo;
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) {
    const float a = w0[c], b = w1[c], e = w2[c], f = w3[c];
    o0[c] = a * g0[c] + b * g1[c] + e * g2[c] + f * g3[c];
    o1[c] = a * g1[c] + b * g2[c] + e * g3[c] + f * g4[c];
    o2[c] = a * g2[c] + b * g3[c] + e * g4[c] + f * g5[c];
    o3[c] = a * g3[c] + b * g4[c] + e * g5[c] + f * g6[c];
  }
}

template <typename GpreRow>
void conv_in_grad_row(const ConvDims& s, GpreRow gpre_row, const float* pw, int64_t bi, int64_t xt,
                      float* __restrict__ o) {
  const int64_t t0 = xt - s.P;
  if (read_by_all4(s, bi, xt)) {
    const float *g0 = gpre_row(t0), *g1 = gpre_row(t0 + 1), *g2 = gpre_row(t0 + 2), *g3 = gpre_row(t0 + 3);
    const float *w0 = pw + 3 * s.d, *w1 = pw + 2 * s.d, *w2 = pw + s.d, *w3 = pw;
#pragma omp simd
    for (int64_t c = 0; c < s.d; ++c) o[c] = w0[c] * g0[c] + w1[c] * g1[c] + w2[c] * g2[c] + w3[c] * g3[c];
    return;
  }
  std::fill(o, o + s.d, 0.0f);
  for (int64_t j = 0; j < s.K; ++j) {
    const int64_t t = t0 + j;
    if (t < 0 || t >= s.L || j > s.reach(bi, t)) continue;
    const float* __restrict__ gp = gpre_row(t);
    const float* __restrict__ wk = pw + (s.K - 1 - j) * s.d;
#pragma omp simd
    for (int64_t c = 0; c < s.d; ++c) o[c] += wk[c] * gp[c];
  }
}

// The backward's first half for the rows [t_begin, t_end) of batch row bi: gpre (dLoss/d(pre-activation)) into
// out (row t_begin first, rows d apart), and the rows' weight / bias gradients added into gw (K taps, then the
// bias).
struct ConvGrads {
  const ConvDims& s;
  const float *x, *w, *bias, *g;
  int64_t gsb, gst;
  bool silu;

  void gpre_rows(int64_t bi, int64_t t_begin, int64_t t_end, float* out, float* gw) const {
    for (int64_t t = t_begin; t < t_end; ++t) {
      float* __restrict__ gp = out + (t - t_begin) * s.d;
      const float* __restrict__ gr = g + bi * gsb + t * gst;
      if (t + 4 <= t_end && s.full_block4(bi, t)) {  // rows t..t+3 at once
        const float* xs[7];
        const float* gs[4];
        float* gps[4];
        for (int64_t i = 0; i < 7; ++i) xs[i] = s.row(x, bi, s.P + t - 3 + i);
        for (int64_t i = 0; i < 4; ++i) gs[i] = gr + i * gst, gps[i] = gp + i * s.d;
        if (silu) bias ? conv_block4_backward<true, true>(xs, gs, gps, w, bias, s.d, gw)
                       : conv_block4_backward<true, false>(xs, gs, gps, w, bias, s.d, gw);
        else bias ? conv_block4_backward<false, true>(xs, gs, gps, w, bias, s.d, gw)
                  : conv_block4_backward<false, false>(xs, gs, gps, w, bias, s.d, gw);
        t += 3;
        continue;
      }
      if (s.K == K4 && s.reach(bi, t) == K4 - 1) {
        const Taps4 tp(s, x, bi, t);
        if (silu) bias ? conv_row4_backward<true, true>(tp, w, bias, gr, s.d, gp, gw)
                       : conv_row4_backward<true, false>(tp, w, bias, gr, s.d, gp, gw);
        else bias ? conv_row4_backward<false, true>(tp, w, bias, gr, s.d, gp, gw)
                  : conv_row4_backward<false, false>(tp, w, bias, gr, s.d, gp, gw);
        continue;
      }
      gpre_row_general(bi, t, gr, gp, gw);
    }
  }

  void gpre_row_general(int64_t bi, int64_t t, const float* gr, float* __restrict__ gp, float* gw) const {
    if (silu) {
      conv_row(s, x, w, bias, bi, t, gp);
#pragma omp simd
      for (int64_t c = 0; c < s.d; ++c) gp[c] = gr[c] * dsilu(gp[c], sigmoid(gp[c]));
    } else {
      std::copy(gr, gr + s.d, gp);
    }
    for (int64_t j = 0; j <= s.reach(bi, t); ++j) {
      const float* __restrict__ xr = s.row(x, bi, s.P + t - j);
      float* __restrict__ gwk = gw + (s.K - 1 - j) * s.d;
#pragma omp simd
      for (int64_t c = 0; c < s.d; ++c) gwk[c] += gp[c] * xr[c];
    }
    float* __restrict__ gbt = gw + s.K * s.d;
#pragma omp simd
    for (int64_t c = 0; c < s.d; ++c) gbt[c] += gp[c];
  }
};

// output rows per tile of the backward: a tile's gpre rows (and the next K - 1, made again by the next tile)
// stay in an L2-sized buffer while its input gradients are made from them
constexpr int64_t CONV_TILE = 32;

}  // namespace

torch::Tensor conv_silu_forward(torch::Tensor x, torch::Tensor wT, torch::Tensor bias, int64_t prefix,
                                torch::Tensor back, bool silu, int64_t threads) {
  const ConvDims s(x, wT, prefix, back);
  auto out = torch::empty({s.b, s.L, s.d}, x.options());
  const float *px = x.data_ptr<float>(), *pw = wT.data_ptr<float>();
  const float* pb = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  parallel_channels(s.b * s.L, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bi = r / s.L, t = r % s.L;
      if (r + 4 <= end && s.full_block4(bi, t)) {  // rows t..t+3 at once
        const float* xs[7];
        for (int64_t i = 0; i < 7; ++i) xs[i] = s.row(px, bi, s.P + t - 3 + i);
        if (silu) pb ? conv_block4<true, true>(xs, pw, pb, s.d, po + r * s.d, s.d)
                     : conv_block4<true, false>(xs, pw, pb, s.d, po + r * s.d, s.d);
        else pb ? conv_block4<false, true>(xs, pw, pb, s.d, po + r * s.d, s.d)
                : conv_block4<false, false>(xs, pw, pb, s.d, po + r * s.d, s.d);
        r += 3;
        continue;
      }
      conv_out_row(s, px, pw, pb, silu, bi, t, po + r * s.d);
    }
  });
  return out;
}

// (gx (b, P + L, d) contiguous, gwT (K, d), gbias (d) or empty) from gout (b, L, d) with unit channel stride.
std::vector<torch::Tensor> conv_silu_backward(torch::Tensor gout, torch::Tensor x, torch::Tensor wT,
                                              torch::Tensor bias, int64_t prefix, torch::Tensor back, bool silu,
                                              int64_t threads) {
  const ConvDims s(x, wT, prefix, back);
  TORCH_CHECK(gout.numel() == 0 || gout.stride(2) == 1, "conv_silu: gout needs unit channel stride");
  // no output rows: no tile, and the history rows' gradients are 0
  auto gx = s.L ? torch::empty({s.b, s.P + s.L, s.d}, x.options()) : torch::zeros({s.b, s.P, s.d}, x.options());
  auto gw_part = torch::zeros({slots(threads), s.K + 1, s.d}, x.options());  // per thread: K taps, then the bias
  const ConvGrads cg{s, x.data_ptr<float>(), wT.data_ptr<float>(), bias.numel() ? bias.data_ptr<float>() : nullptr,
                     gout.data_ptr<float>(), gout.stride(0), gout.stride(1), silu};
  float *pgx = gx.data_ptr<float>(), *pgw = gw_part.data_ptr<float>();
  const int64_t tiles = (s.L + CONV_TILE - 1) / CONV_TILE, rows = s.P + s.L;
  parallel_channels(s.b * tiles, static_cast<int>(threads), [&](int th, int64_t begin, int64_t end) {
    std::vector<float> buf((CONV_TILE + s.K - 1) * s.d), spare((s.K + 1) * s.d);
    float* gwt = pgw + th * (s.K + 1) * s.d;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t bi = tile / tiles, t0 = (tile % tiles) * CONV_TILE;
      const int64_t t1 = std::min(t0 + CONV_TILE, s.L), t2 = std::min(t1 + s.K - 1, s.L);
      cg.gpre_rows(bi, t0, t1, buf.data(), gwt);
      cg.gpre_rows(bi, t1, t2, buf.data() + (t1 - t0) * s.d, spare.data());  // the next tile's, again there
      auto gpre_row = [&](int64_t t) { return buf.data() + (t - t0) * s.d; };
      const int64_t xt_end = t1 == s.L ? rows : t1 + s.P;
      for (int64_t xt = t0 == 0 ? 0 : t0 + s.P; xt < xt_end; ++xt) {
        float* o = pgx + (bi * rows + xt) * s.d;
        if (xt + 4 <= xt_end && read_by_all4(s, bi, xt) && read_by_all4(s, bi, xt + 1) &&
            read_by_all4(s, bi, xt + 2) && read_by_all4(s, bi, xt + 3)) {
          const float* gs[7];
          for (int64_t i = 0; i < 7; ++i) gs[i] = gpre_row(xt - s.P + i);
          conv_in_grad_block4(gs, cg.w, s.d, o, s.d);
          xt += 3;
          continue;
        }
        conv_in_grad_row(s, gpre_row, cg.w, bi, xt, o);
      }
    }
  });
  auto gw = gw_part.sum(0);
  // copies, not views of gw: a custom op's outputs may not alias one another
  return {gx, gw.narrow(0, 0, s.K).clone(), cg.bias ? gw[s.K].clone() : torch::empty({0}, x.options())};
}

// ------------------------------------------------------------------------------------------------------------
// The gated RMSNorm after Mamba-2's scan and Gated DeltaNet's delta rule (mamba-ssm's RMSNormGated with
// norm_before_gate = false), fused, over (b, L, d) rows split into groups of G channels:
//     y   = x * silu(z)
//     out = y * rstd * w,   rstd = 1 / sqrt(mean over the group of y^2 + eps)
// Through autograd this is ~7 passes over (b, L, d) forward and ~12 backward; here one row at a time (it stays
// in L1): forward reads x and z and writes out (and rstd, one float per row and group); backward recomputes y
// and writes gx and gz:
//     dyn = gout * w;  dy = rstd (dyn - yn mean_group(dyn yn));  gx = dy silu(z);  gz = dy x dsilu(z)
//     gw  = sum over rows of gout * yn                                    (per-thread partials, summed at the end)
// x, z, gout: unit channel stride, any batch / time strides; w (d) contiguous; outputs contiguous.

namespace {

struct NormDims {
  int64_t b, L, d, G;
  NormDims(const torch::Tensor& x, int64_t group) : b(x.size(0)), L(x.size(1)), d(x.size(2)), G(group) {
    TORCH_CHECK(group > 0 && x.size(2) % group == 0, "gated_rms_norm: the width must be a multiple of the group");
  }
};

struct Rows3 {
  const float* p;
  int64_t sb, st;
  explicit Rows3(const torch::Tensor& x) : p(x.data_ptr<float>()), sb(x.stride(0)), st(x.stride(1)) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "gated_rms_norm: inputs need shape (b, L, d), unit channel stride");
  }
  const float* row(int64_t r, int64_t L) const { return p + (r / L) * sb + (r % L) * st; }
};

}  // namespace

std::vector<torch::Tensor> gated_norm_forward(torch::Tensor x, torch::Tensor z, torch::Tensor w, int64_t group,
                                              double eps, int64_t threads) {
  const NormDims s(x, group);
  const Rows3 xs(x), zs(z);
  const int64_t ng = s.d / s.G;
  auto out = torch::empty({s.b, s.L, s.d}, x.options());
  auto rstd = torch::empty({s.b, s.L, ng}, x.options());
  const float* pw = w.data_ptr<float>();
  float *po = out.data_ptr<float>(), *pr = rstd.data_ptr<float>();
  parallel_channels(s.b * s.L, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ xr = xs.row(r, s.L);
      const float* __restrict__ zr = zs.row(r, s.L);
      float* __restrict__ o = po + r * s.d;
      for (int64_t g0 = 0, gi = 0; g0 < s.d; g0 += s.G, ++gi) {
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = g0; c < g0 + s.G; ++c) {
          const float y = xr[c] * zr[c] * sigmoid(zr[c]);
          o[c] = y;
          ss += y * y;
        }
        const float rs = 1.0f / std::sqrt(ss / static_cast<float>(s.G) + static_cast<float>(eps));
        pr[r * ng + gi] = rs;
#pragma omp simd
        for (int64_t c = g0; c < g0 + s.G; ++c) o[c] *= rs * pw[c];
      }
    }
  });
  return {out, rstd};
}

// (gx, gz (b, L, d) contiguous, gw (d)) from gout (b, L, d) with unit channel stride.
std::vector<torch::Tensor> gated_norm_backward(torch::Tensor gout, torch::Tensor x, torch::Tensor z,
                                               torch::Tensor w, torch::Tensor rstd, int64_t group,
                                               int64_t threads) {
  const NormDims s(x, group);
  const Rows3 xs(x), zs(z), gs(gout);
  const int64_t ng = s.d / s.G;
  auto gx = torch::empty({s.b, s.L, s.d}, x.options());
  auto gz = torch::empty({s.b, s.L, s.d}, x.options());
  auto gw_part = torch::zeros({slots(threads), s.d}, x.options());
  const float *pw = w.data_ptr<float>(), *pr = rstd.data_ptr<float>();
  float *pgx = gx.data_ptr<float>(), *pgz = gz.data_ptr<float>(), *pgw = gw_part.data_ptr<float>();
  parallel_channels(s.b * s.L, static_cast<int>(threads), [&](int th, int64_t begin, int64_t end) {
    float* __restrict__ gwt = pgw + th * s.d;
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ xr = xs.row(r, s.L);
      const float* __restrict__ zr = zs.row(r, s.L);
      const float* __restrict__ g = gs.row(r, s.L);
      float* __restrict__ ox = pgx + r * s.d;  // holds yn until the second pass overwrites it with gx
      float* __restrict__ oz = pgz + r * s.d;  // holds dyn until then
      for (int64_t g0 = 0, gi = 0; g0 < s.G * ng; g0 += s.G, ++gi) {
        const float rs = pr[r * ng + gi];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = g0; c < g0 + s.G; ++c) {
          const float yn = xr[c] * zr[c] * sigmoid(zr[c]) * rs, dyn = g[c] * pw[c];
          gwt[c] += g[c] * yn;
          ox[c] = yn;
          oz[c] = dyn;
          dot += dyn * yn;
        }
        const float m = dot / static_cast<float>(s.G);
#pragma omp simd
        for (int64_t c = g0; c < g0 + s.G; ++c) {
          const float sg = sigmoid(zr[c]), dy = rs * (oz[c] - ox[c] * m);
          ox[c] = dy * zr[c] * sg;
          oz[c] = dy * xr[c] * dsilu(zr[c], sg);
        }
      }
    }
  });
  return {gx, gz, gw_part.sum(0)};
}

// The plain RMSNorm (every architecture's pre-norms), fused the same way, over (b, L, d) rows:
//     out = x * rstd * w,   rstd = 1 / sqrt(mean x^2 + eps)
// backward: xn = x rstd;  gx = rstd (gout w - xn mean(gout w xn));  gw = sum over rows of gout * xn.
// torch's rms_norm on CPU is ~5 ops forward and ~8 backward through autograd, each a pass over (b, L, d).
std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor w, double eps, int64_t threads) {
  const NormDims s(x, x.size(2));
  const Rows3 xs(x);
  auto out = torch::empty({s.b, s.L, s.d}, x.options());
  auto rstd = torch::empty({s.b, s.L, 1}, x.options());
  const float* pw = w.data_ptr<float>();
  float *po = out.data_ptr<float>(), *pr = rstd.data_ptr<float>();
  const float inv_d = 1.0f / static_cast<float>(s.d);
  parallel_channels(s.b * s.L, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ xr = xs.row(r, s.L);
      float* __restrict__ o = po + r * s.d;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < s.d; ++c) ss += xr[c] * xr[c];
      const float rs = 1.0f / std::sqrt(ss * inv_d + static_cast<float>(eps));
      pr[r] = rs;
#pragma omp simd
      for (int64_t c = 0; c < s.d; ++c) o[c] = xr[c] * rs * pw[c];
    }
  });
  return {out, rstd};
}

// (gx (b, L, d) contiguous, gw (d)) from gout (b, L, d) with unit channel stride.
std::vector<torch::Tensor> rms_norm_backward(torch::Tensor gout, torch::Tensor x, torch::Tensor w,
                                             torch::Tensor rstd, int64_t threads) {
  const NormDims s(x, x.size(2));
  const Rows3 xs(x), gs(gout);
  auto gx = torch::empty({s.b, s.L, s.d}, x.options());
  auto gw_part = torch::zeros({slots(threads), s.d}, x.options());
  const float *pw = w.data_ptr<float>(), *pr = rstd.data_ptr<float>();
  float *pgx = gx.data_ptr<float>(), *pgw = gw_part.data_ptr<float>();
  const float inv_d = 1.0f / static_cast<float>(s.d);
  parallel_channels(s.b * s.L, static_cast<int>(threads), [&](int th, int64_t begin, int64_t end) {
    float* __restrict__ gwt = pgw + th * s.d;
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ xr = xs.row(r, s.L);
      const float* __restrict__ g = gs.row(r, s.L);
      float* __restrict__ ox = pgx + r * s.d;
      const float rs = pr[r];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < s.d; ++c) {
        const float xn = xr[c] * rs;
        gwt[c] += g[c] * xn;
        dot += g[c] * pw[c] * xn;
      }
      const float m = dot * inv_d;
#pragma omp simd
      for (int64_t c = 0; c < s.d; ++c) ox[c] = rs * (g[c] * pw[c] - xr[c] * rs * m);
    }
  });
  return {gx, gw_part.sum(0)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &scan_forward, "selective scan forward (CPU, fp32)");
  m.def("backward", &scan_backward, "selective scan backward (CPU, fp32)");
  m.def("conv_silu_forward", &conv_silu_forward, "causal depthwise conv (+ silu) forward (CPU, fp32)");
  m.def("conv_silu_backward", &conv_silu_backward, "causal depthwise conv (+ silu) backward (CPU, fp32)");
  m.def("gated_norm_forward", &gated_norm_forward, "gated RMSNorm forward (CPU, fp32)");
  m.def("gated_norm_backward", &gated_norm_backward, "gated RMSNorm backward (CPU, fp32)");
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm forward (CPU, fp32)");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm backward (CPU, fp32)");
  m.def("cross_entropy_forward", &cross_entropy_forward, "cross-entropy and its gradient (CPU, fp32)");
  m.def("cross_entropy_scale_grad", &cross_entropy_scale_grad, "the loss gradient times the upstream one (CPU)");
  m.def("gated_delta_scan_forward", &gated_delta_scan_forward, "gated delta rule chunk loop forward (CPU, fp32)");
  m.def("gated_delta_scan_backward", &gated_delta_scan_backward, "gated delta rule chunk loop backward (CPU, fp32)");
  m.def("gated_delta_chunk_forward", &gated_delta_chunk_forward, "the chunk loop forward with its factors (CPU)");
  m.def("gated_delta_chunk_backward", &gated_delta_chunk_backward, "the chunk loop backward with its factors (CPU)");
  m.def("ssd_forward", &ssd_forward, "Mamba-2 SSD chunked scan forward (CPU, fp32)");
  m.def("ssd_backward", &ssd_backward, "Mamba-2 SSD chunked scan backward (CPU, fp32)");
}
