// Cross-entropy of (N, V) fp32 logits against N targets, with its gradient computed in the same pass.
//
// Through autograd F.cross_entropy on CPU is log_softmax (two passes over the logits, one write), nll_loss, and
// backward nll_loss_backward (a zeroed (N, V) write and a scatter) then log_softmax_backward (reads both, one
// write): ~70 ms of a ~1.1 s Mamba-2 training step at (2048, 8192). Here each row is read once from memory and
// then worked on in cache: its max and sum, exp(x - max) written into the gradient row, and the gradient
// scaled in place. Per row, with eps the label smoothing, t the target and lse = max + log sum exp(x - max):
//     loss = lse - (1 - eps) x_t - (eps / V) sum x
//     grad = (softmax(x) - eps / V - (1 - eps) onehot(t)) / n                    (n: the rows not ignored)
// A row whose target is ignore_index has loss 0 and a zero gradient. Row losses are returned unsummed, so their
// sum (in torch) does not depend on the thread count; n comes back as a tensor, so the caller's mean needs no
// read of it on the host (the trainer allows one per step).
#include "cross_entropy_cpu.h"

#include "cpu_common.h"

#include <cmath>
#include <cstring>

using archscale_cpu::fast_exp;
using archscale_cpu::parallel_channels;

namespace {

// One row: writes the gradient row g (V floats) and returns the row's loss.
float row_loss_and_grad(const float* __restrict__ x, float* __restrict__ g, int64_t V, int64_t t, float eps,
                        float scale) {
  float mx = -INFINITY, sx = 0.0f;
#pragma omp simd reduction(max : mx) reduction(+ : sx)
  for (int64_t c = 0; c < V; ++c) {
    mx = std::max(mx, x[c]);
    sx += x[c];
  }
  float se = 0.0f;
#pragma omp simd reduction(+ : se)
  for (int64_t c = 0; c < V; ++c) {
    const float e = fast_exp(x[c] - mx);
    g[c] = e;
    se += e;
  }
  const float lse = mx + std::log(se);
  const float k = scale / se, off = eps / static_cast<float>(V) * scale;
#pragma omp simd
  for (int64_t c = 0; c < V; ++c) g[c] = g[c] * k - off;
  g[t] -= (1.0f - eps) * scale;
  return lse - (1.0f - eps) * x[t] - (eps / static_cast<float>(V)) * sx;
}

}  // namespace

// logits (N, V) fp32 with unit inner stride (any row stride); targets (N,) int64. Returns (row losses (N,),
// grad (N, V) contiguous, already / n, n as a float32 scalar tensor).
std::vector<torch::Tensor> cross_entropy_forward(torch::Tensor logits, torch::Tensor targets, int64_t ignore_index,
                                                 double label_smoothing, int64_t threads) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "cross_entropy: logits must be (N, V) float32 with unit inner stride");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == torch::kLong &&
                  targets.is_contiguous(), "cross_entropy: targets must be (N,) int64 contiguous");
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const int64_t* tg = targets.data_ptr<int64_t>();
  int64_t valid = 0;
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(tg[r] == ignore_index || (tg[r] >= 0 && tg[r] < V), "cross_entropy: target ", tg[r],
                " is out of bounds for ", V, " classes");
    valid += tg[r] != ignore_index;
  }
  auto losses = torch::empty({N}, logits.options());
  auto grad = torch::empty({N, V}, logits.options());
  const float* px = logits.data_ptr<float>();
  float *pl = losses.data_ptr<float>(), *pg = grad.data_ptr<float>();
  // every row ignored: no gradient row is scaled, and the mean is 0 / 0 = nan, as F.cross_entropy's
  const float eps = static_cast<float>(label_smoothing), scale = valid ? 1.0f / static_cast<float>(valid) : 0.0f;
  parallel_channels(N, static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (tg[r] == ignore_index) {
        pl[r] = 0.0f;
        std::memset(pg + r * V, 0, sizeof(float) * V);
      } else {
        pl[r] = row_loss_and_grad(px + r * ld, pg + r * V, V, tg[r], eps, scale);
      }
    }
  });
  return {losses, grad, torch::full({}, static_cast<float>(valid), logits.options())};
}

// grad *= factor (a one-element tensor), skipped when factor is exactly 1: the usual loss.backward() costs no pass.
void cross_entropy_scale_grad(torch::Tensor grad, torch::Tensor factor, int64_t threads) {
  const float f = factor.item<float>();
  if (f == 1.0f) return;
  float* g = grad.data_ptr<float>();
  parallel_channels(grad.numel(), static_cast<int>(threads), [&](int, int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) g[i] *= f;
  });
}
