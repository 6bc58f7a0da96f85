// AdamW on CPU as one MindSpore `ops.Custom` AOT kernel per parameter (dvm_fusion/adamw.py): the gradient's
// scaling (unscale, 1 / dp, clip factor), both moments and the decoupled-decay update in one pass over four float32
// arrays, where MindSpore's path was a Mul per gradient and AdamWeightDecay (113M parameters: 450 against 230 ms).
// Like AdamWeightDecay it updates its inputs in place: the parameter and both moments are written through the
// pointers MindSpore hands in (a Parameter's own buffer); the one-element output is a status for the graph to
// keep the call by. Large arrays are split over `threads` threads: one thread does not reach the memory bandwidth
// (the same 113M parameters: 400 ms on one thread, 230 on two).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

// hyper: lr, beta1, beta2, eps, gradient factor, 1 - beta1^t, sqrt(1 - beta2^t), threads
struct Hyper {
  float lr, beta1, beta2, eps, factor, correction1, root_correction2, threads;
};

void update(float *__restrict p, float *__restrict m, float *__restrict v, const float *__restrict g, int64_t lo,
            int64_t hi, const Hyper &h, float weight_decay) {
  // torch.optim.AdamW's order of operations: decay, moments, then p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
  const float decay = 1.0f - h.lr * weight_decay, step = h.lr / h.correction1;
  const float b1 = h.beta1, b2 = h.beta2, c1 = 1.0f - h.beta1, c2 = 1.0f - h.beta2;
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g[i] * h.factor;
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * (mi / (std::sqrt(vi) / h.root_correction2 + h.eps));
  }
}

}  // namespace

extern "C" {

// Inputs: param, exp_avg, exp_avg_sq, grad (float32, one size), hyper (float32 [8], Hyper's order), weight decay
// (float32 [] or [1]); output float32 [1] (0). Returns 0; 1: an input not float32; 2: sizes differ.
int AdamW(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  for (int t = 1; t < 4; ++t) {
    int64_t size = 1;
    for (int d = 0; d < ndims[t]; ++d) size *= shapes[t][d];
    if (size != n) return 2;
  }
  auto *p = static_cast<float *>(params[0]), *m = static_cast<float *>(params[1]), *v = static_cast<float *>(params[2]);
  const auto *g = static_cast<const float *>(params[3]);
  Hyper h;
  std::memcpy(&h, params[4], sizeof h);
  const float weight_decay = *static_cast<const float *>(params[5]);
  // a thread per 256K elements at most: below that starting one costs more than it saves
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(h.threads), n >> 18));
  const int64_t chunk = ((n + threads - 1) / threads + 15) & ~int64_t(15);   // 64-byte aligned starts
  std::vector<std::thread> others;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t lo = std::min(n, t * chunk), hi = std::min(n, (t + 1) * chunk);
    others.emplace_back(update, p, m, v, g, lo, hi, std::cref(h), weight_decay);
  }
  update(p, m, v, g, 0, std::min(n, chunk), h, weight_decay);
  for (auto &t : others) t.join();
  *static_cast<float *>(params[nparam - 1]) = 0.0f;
  return 0;
}

}  // extern "C"
