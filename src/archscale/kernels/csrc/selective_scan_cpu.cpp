// Mamba-1 selective scan on CPU: one fused pass per channel, forward and backward.
//
// The pure-PyTorch chunked scan (selective_scan.py) materialises (steps, batch, d_inner, d_state) tensors and
// makes ~30 passes over them per layer and step: on CPU it is memory-bound. Here each (batch, channel) pair runs
// its recurrence with the d_state-long state in registers, reading only the (batch, channel, time) and
// (batch, time, d_state) inputs; nothing of size time x d_state x d_inner is ever written. The elementwise
// tail of the scan (the D skip, the silu(z) gate) is fused in, so the Mamba layer makes no extra passes after
// it (dt's bias and softplus stay in torch, whose vectorised softplus is faster than a scalar one here). Backward recomputes the states of one block (BLOCK steps) at a time
// from the state saved at the block start, then runs the adjoint recurrence in reverse. Semantics are those
// of `selective_scan(..., impl="ref")` (the test oracle):
//     a_t = exp(dt_t * A) * keep_t;  h_t = a_t h_{t-1} + dt_t u_t B_t
//     y_t = (C_t . h_t + D u_t) * silu(z_t)
// Layouts, fp32: u, dt, z, gy: (b, d, L) with any strides (the Mamba layer passes transposed views);
// A (d, n); Bt, Ct (b, L, n) contiguous; h0 (b, d, n); keep (b, L) or empty; D (d) or empty; z may be
// empty. y is written (b, L, d)-contiguous: what out_proj reads.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// exp(x) for float, Cephes' polynomial (~1 ulp); exactly 0 below -87.3 (where expf underflows anyway), so a
// strong decay vanishes as in the reference. Written so the d_state loop vectorises: branch-free selects,
// rounding by the 1.5 * 2^23 trick (std::floor kept gcc from vectorising), the exponent by a bit cast.
inline float fast_exp(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(xc / ln 2)
  const float r = xc - k * 0.693359375f + k * 2.12194440e-4f;              // xc - k ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);  // 2^k
  return x < -87.3f ? 0.0f : p * scale;
}

// Runs fn(thread, begin, end) over [0, total) on up to `threads` std::threads (no OpenMP: torch ships its own
// runtime, and a second one in the process would compete with it).
template <typename Fn>
void parallel_channels(int64_t total, int threads, Fn fn) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, total)));
  if (threads == 1) {
    fn(0, 0, total);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (total + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = t * per, end = std::min(total, begin + per);
    if (begin < end) pool.emplace_back(fn, t, begin, end);
  }
  for (auto& th : pool) th.join();
}

// A (b, d, L) tensor with arbitrary strides, read per element.
struct View {
  const float* p;
  int64_t sb, sd, st;
  View(const torch::Tensor& x)
      : p(x.numel() ? x.data_ptr<float>() : nullptr), sb(x.dim() == 3 ? x.stride(0) : 0),
        sd(x.dim() == 3 ? x.stride(1) : 0), st(x.dim() == 3 ? x.stride(2) : 0) {}
  float at(int64_t b, int64_t d, int64_t t) const { return p[b * sb + d * sd + t * st]; }
};

struct Dims {
  int64_t b, d, L, n, block, nblocks;
};

Dims dims_of(const torch::Tensor& u, const torch::Tensor& A, int64_t block) {
  Dims s{u.size(0), u.size(1), u.size(2), A.size(1), block, 0};
  s.nblocks = (s.L + block - 1) / block;
  return s;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }  // 0 / 1 at the clamps, as expf

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
  // dt of channel (bi, di) for every step, contiguous
  void dt_row(const Dims& s, int64_t bi, int64_t di, float* row) const {
    for (int64_t t = 0; t < s.L; ++t) row[t] = dt.at(bi, di, t);
  }
};

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
  parallel_channels(s.b * s.d, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    std::vector<float> h(s.n), dtr(s.L), yrow(s.L);
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t bi = ch / s.d, di = ch % s.d;
      const float* Ad = in.A + di * s.n;
      const float Dd = in.D ? in.D[di] : 0.0f;
      in.dt_row(s, bi, di, dtr.data());
      if (in.h0) std::copy(in.h0 + ch * s.n, in.h0 + (ch + 1) * s.n, h.begin());
      else std::fill(h.begin(), h.end(), 0.0f);
      for (int64_t t = 0; t < s.L; ++t) {
        if (t % s.block == 0) std::copy(h.begin(), h.end(), pst + (ch * s.nblocks + t / s.block) * s.n);
        const float dtv = dtr[t], uv = in.u.at(bi, di, t), x = dtv * uv;
        const float kv = in.keep ? in.keep[bi * s.L + t] : 1.0f;
        const float *Bl = in.Bt + (bi * s.L + t) * s.n, *Cl = in.Ct + (bi * s.L + t) * s.n;
        float* hp = h.data();
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < s.n; ++j) {
          hp[j] = fast_exp(dtv * Ad[j]) * kv * hp[j] + x * Bl[j];
          acc += hp[j] * Cl[j];
        }
        yrow[t] = acc + Dd * uv;
      }
      if (in.z.p) {  // the gate, in its own loop over time so sigmoid vectorises
        float* yr = yrow.data();
#pragma omp simd
        for (int64_t t = 0; t < s.L; ++t) {
          const float zv = in.z.at(bi, di, t);
          yr[t] *= zv * sigmoid(zv);
        }
      }
      for (int64_t t = 0; t < s.L; ++t) py[(bi * s.L + t) * s.d + di] = yrow[t];
      std::copy(h.begin(), h.end(), plast + ch * s.n);
    }
  });
  return {y, last, starts};
}

// Gradients (gu (b, d, L), gdt (b, L, d), gA, gB, gC (b, L, n), gh0, gD, gz (b, L, d)) from gy (b, d, L, any
// strides) and glast (b, d, n). Absent inputs get empty gradients. gdt is written (b, L, d) because the Mamba
// layer's dt is a transposed view of dt_proj's (b, L, d) output: torch's softplus backward and dt_proj's
// backward then read it in that layout, with no strided pass or copy.
std::vector<torch::Tensor> scan_backward(torch::Tensor gy, torch::Tensor glast, torch::Tensor u, torch::Tensor dt,
                                         torch::Tensor A, torch::Tensor Bt, torch::Tensor Ct, torch::Tensor keep,
                                         torch::Tensor D, torch::Tensor z, torch::Tensor starts, int64_t block,
                                         int64_t threads) {
  const Dims s = dims_of(u, A, block);
  const Inputs in(u, dt, A, Bt, Ct, torch::empty({0}, u.options()), keep, D, z);
  const View gyv_(gy);
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, s.b * s.d));
  auto opts = u.options();
  auto gu = torch::empty({s.b, s.d, s.L}, opts), gdt = torch::empty({s.b, s.L, s.d}, opts);
  auto gh0 = torch::empty({s.b, s.d, s.n}, opts);
  auto gz = z.numel() ? torch::empty({s.b, s.L, s.d}, opts) : torch::empty({0}, opts);
  // per-thread partial sums of the gradients that reduce over channels or batch, summed at the end
  auto gA_part = torch::zeros({threads, s.d, s.n}, opts);
  auto gD_part = torch::zeros({threads, s.d}, opts);
  auto gB_part = torch::zeros({threads, s.b, s.L, s.n}, opts);
  auto gC_part = torch::zeros({threads, s.b, s.L, s.n}, opts);
  const float *pgl = glast.data_ptr<float>(), *pst = starts.data_ptr<float>();
  float *pgu = gu.data_ptr<float>(), *pgd = gdt.data_ptr<float>(), *pgh0 = gh0.data_ptr<float>();
  float* pgz = gz.numel() ? gz.data_ptr<float>() : nullptr;
  float *pgA = gA_part.data_ptr<float>(), *pgDp = gD_part.data_ptr<float>();
  float *pgB = gB_part.data_ptr<float>(), *pgC = gC_part.data_ptr<float>();
  parallel_channels(s.b * s.d, static_cast<int>(threads), [&](int th, int64_t begin, int64_t end) {
    std::vector<float> hs((s.block + 1) * s.n), as(s.block * s.n), G(s.n), dtr(s.L);
    std::vector<float> pre(s.block), gyrow(s.block);  // per block: the pre-gate output, dLoss/d(pre)
    float *gAt = pgA + th * s.d * s.n, *gD = pgDp + th * s.d;
    float *gBt = pgB + th * s.b * s.L * s.n, *gCt = pgC + th * s.b * s.L * s.n;
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t bi = ch / s.d, di = ch % s.d;
      const float* Ad = in.A + di * s.n;
      const float Dd = in.D ? in.D[di] : 0.0f;
      float* gAd = gAt + di * s.n;
      in.dt_row(s, bi, di, dtr.data());
      std::copy(pgl + ch * s.n, pgl + (ch + 1) * s.n, G.begin());
      for (int64_t blk = s.nblocks - 1; blk >= 0; --blk) {
        const int64_t t0 = blk * s.block, t1 = std::min(s.L, t0 + s.block);
        // recompute: hs[i] is the state before step t0 + i (hs[0] = the saved block start)
        std::copy(pst + (ch * s.nblocks + blk) * s.n, pst + (ch * s.nblocks + blk + 1) * s.n, hs.begin());
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i = t - t0;
          const float dtv = dtr[t], x = dtv * in.u.at(bi, di, t);
          const float kv = in.keep ? in.keep[bi * s.L + t] : 1.0f;
          const float* Bl = in.Bt + (bi * s.L + t) * s.n;
          const float* hp = hs.data() + i * s.n;
          const float* Cl = in.Ct + (bi * s.L + t) * s.n;
          float *hn = hs.data() + (i + 1) * s.n, *ap = as.data() + i * s.n;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < s.n; ++j) {
            ap[j] = fast_exp(dtv * Ad[j]) * kv;
            hn[j] = ap[j] * hp[j] + x * Bl[j];
            acc += hn[j] * Cl[j];
          }
          pre[i] = acc + Dd * in.u.at(bi, di, t);
        }
        float *gr = gyrow.data(), *pr = pre.data();
        if (in.z.p) {  // through the gate y = pre * silu(z), vectorised over the block's steps
          float* gzc = pgz + bi * s.L * s.d + di;
#pragma omp simd
          for (int64_t i = 0; i < t1 - t0; ++i) {
            const float zv = in.z.at(bi, di, t0 + i), sg = sigmoid(zv), g = gyv_.at(bi, di, t0 + i);
            gzc[(t0 + i) * s.d] = g * pr[i] * sg * (1.0f + zv * (1.0f - sg));
            gr[i] = g * zv * sg;
          }
        } else {
          for (int64_t i = 0; i < t1 - t0; ++i) gr[i] = gyv_.at(bi, di, t0 + i);
        }
        // adjoint: G = dLoss/dh_t, carried backwards through a_t
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const int64_t i = t - t0;
          const float dtv = dtr[t], uv = in.u.at(bi, di, t), x = dtv * uv;
          const int64_t row = (bi * s.L + t) * s.n;
          const float *Bl = in.Bt + row, *Cl = in.Ct + row, *hprev = hs.data() + i * s.n;
          const float *hcur = hs.data() + (i + 1) * s.n, *ap = as.data() + i * s.n;
          const float gyv = gr[i];
          gD[di] += gyv * uv;
          float *gBl = gBt + row, *gCl = gCt + row, *Gp = G.data();
          float gx = 0.0f, gdt_a = 0.0f;
#pragma omp simd reduction(+ : gx, gdt_a)
          for (int64_t j = 0; j < s.n; ++j) {
            const float g = Gp[j] + gyv * Cl[j];
            gCl[j] += gyv * hcur[j];
            gx += g * Bl[j];
            gBl[j] += g * x;
            const float glog = g * ap[j] * hprev[j];  // dLoss/d(dt*A) at (t, j)
            gdt_a += glog * Ad[j];
            gAd[j] += glog * dtv;
            Gp[j] = g * ap[j];
          }
          pgu[ch * s.L + t] = gx * dtv + gyv * Dd;
          pgd[(bi * s.L + t) * s.d + di] = gx * uv + gdt_a;
        }
      }
      std::copy(G.begin(), G.end(), pgh0 + ch * s.n);
    }
  });
  return {gu, gdt, gA_part.sum(0), gB_part.sum(0), gC_part.sum(0), gh0, gD_part.sum(0), gz};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &scan_forward, "selective scan forward (CPU, fp32)");
  m.def("backward", &scan_backward, "selective scan backward (CPU, fp32)");
}
