// What the CPU kernels of this module share: a vectorisable exp, the parallel loop on torch's thread pool and
// row-major gemms on the BLAS torch links.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// The BLAS torch links (MKL in the x86 wheels) exports the Fortran sgemm_; torch's own C++ gemm wrapper is not
// exported. Weak: where no sgemm_ is found the products run through at::mm instead (same results, slower).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace archscale_cpu {

// exp(x) for float, Cephes' polynomial (~1 ulp); exactly 0 below -87.3 (where expf underflows anyway), so a
// strong decay vanishes as in the reference. Written so the d_state loop vectorises: branch-free selects,
// rounding by the 1.5 * 2^23 trick (std::floor kept gcc from vectorising), the exponent by a bit cast. Always
// inlined: called out of line (gcc's choice inside a template), the loop around it ran 10x slower.
inline __attribute__((always_inline)) float fast_exp(float x) {
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

// Runs fn(slot, begin, end) over [0, total) in torch's own intra-op thread pool (OpenMP: the module is compiled
// with -fopenmp and not linked to any runtime, so it uses the one torch loaded), one piece per thread; slot is
// the running thread's index, below slots(threads). Separate std::threads competed for the cores with torch's
// pool threads, which spin-wait after every op: on 2 cores that cost the Mamba step ~10%.
template <typename Fn>
void parallel_channels(int64_t total, int threads, Fn fn) {
  if (threads <= 1 || total <= 1) {
    fn(0, 0, total);
    return;
  }
  const int64_t per = (total + threads - 1) / threads;
  at::parallel_for(0, total, per, [&](int64_t begin, int64_t end) { fn(at::get_thread_num(), begin, end); });
}

// A row-major M x K matrix (K x M stored when t) at p with leading dimension ld, as a tensor view (no copy).
inline torch::Tensor matrix(const float* p, bool t, int64_t M, int64_t K, int64_t ld) {
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

}  // namespace archscale_cpu
