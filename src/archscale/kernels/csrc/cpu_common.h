// What the CPU kernels of this module share: a vectorisable exp and the parallel loop on torch's thread pool.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace archscale_cpu {

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

}  // namespace archscale_cpu
