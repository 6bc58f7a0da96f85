// AdamW on CPU as one MindSpore `ops.Custom` AOT kernel over any number of parameters (dvm_fusion/adamw.py; the
// optimizer passes all of them in one call): the gradients' scaling (unscale, 1 / dp, clip factor), both moments
// and the decoupled-decay update in one pass over four float32 arrays per parameter. MindSpore's path was a Mul per
// gradient, then AdamWeightDecay per parameter (113M parameters: 450 against 230 ms).
// Like AdamWeightDecay it updates its inputs in place: each parameter and its moments are written through the
// pointers MindSpore hands in (a Parameter's own buffer); the one-element output is a status for the graph to keep
// the call by. The parameters' elements, end to end, are split evenly over `threads` threads: one thread does not
// reach the memory bandwidth (113M parameters: 400 ms on one thread, 230 on two).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

// hyper: lr, beta1, beta2, eps, gradient factor, 1 - beta1^t, sqrt(1 - beta2^t), threads, finite (1, else the
// step is skipped)
struct Hyper {
  float lr, beta1, beta2, eps, factor, correction1, root_correction2, threads, finite;
};

struct Tensors {
  std::vector<float *> p, m, v;
  std::vector<const float *> g;
  std::vector<int64_t> start;        // element offset of each parameter in the end-to-end order; start[n] = total
  const float *decay;                // [n]
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

// the elements [lo, hi) of the end-to-end order, parameter by parameter
void update_range(const Tensors &t, const Hyper &h, int64_t lo, int64_t hi) {
  const size_t n = t.p.size();
  size_t k = std::upper_bound(t.start.begin(), t.start.end(), lo) - t.start.begin() - 1;
  for (; k < n && t.start[k] < hi; ++k) {
    const int64_t a = std::max(lo, t.start[k]) - t.start[k], b = std::min(hi, t.start[k + 1]) - t.start[k];
    update(t.p[k], t.m[k], t.v[k], t.g[k], a, b, h, t.decay[k]);
  }
}

// every element of `t`, end to end, split evenly over h.threads threads
void update_all(const Tensors &t, const Hyper &h) {
  const int64_t total = t.start.back();
  // a thread per 256K elements at most: below that starting one costs more than it saves
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(h.threads), total >> 18));
  const int64_t chunk = ((total + threads - 1) / threads + 15) & ~int64_t(15);   // whole 16-float blocks
  std::vector<std::thread> others;
  for (int64_t i = 1; i < threads; ++i)
    others.emplace_back(update_range, std::cref(t), std::cref(h), std::min(total, i * chunk),
                        std::min(total, (i + 1) * chunk));
  update_range(t, h, 0, std::min(total, chunk));
  for (auto &other : others) other.join();
}

int64_t elements(int ndim, const int64_t *shape) {
  int64_t s = 1;
  for (int d = 0; d < ndim; ++d) s *= shape[d];
  return s;
}

}  // namespace

extern "C" {

// Inputs: n parameters, their n exp_avg, n exp_avg_sq, n gradients (float32, each group in the same order and
// sizes), hyper (float32 [9], Hyper's order), weight decays (float32 [n]); output float32 [1] (0).
// Returns 0; 1: an input not float32; 2: sizes differ or the input count is not 4n + 2.
int AdamW(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  if ((nparam - 3) % 4 != 0) return 2;
  const int n = (nparam - 3) / 4;
  auto size = [&](int i) { return elements(ndims[i], shapes[i]); };
  if (size(4 * n + 1) != n) return 2;
  Tensors t;
  t.start.push_back(0);
  for (int k = 0; k < n; ++k) {
    const int64_t s = size(k);
    if (size(n + k) != s || size(2 * n + k) != s || size(3 * n + k) != s) return 2;
    t.p.push_back(static_cast<float *>(params[k]));
    t.m.push_back(static_cast<float *>(params[n + k]));
    t.v.push_back(static_cast<float *>(params[2 * n + k]));
    t.g.push_back(static_cast<const float *>(params[3 * n + k]));
    t.start.push_back(t.start.back() + s);
  }
  Hyper h;
  std::memcpy(&h, params[4 * n], sizeof h);
  t.decay = static_cast<const float *>(params[4 * n + 1]);
  *static_cast<float *>(params[nparam - 1]) = 0.0f;
  if (h.finite != 1.0f) return 0;
  update_all(t, h);
  return 0;
}

// One rank's slice of a bucket (the distributed optimizer, parallel/optim): the parameters laid end to end form
// the bucket; elements [lo, lo + S) of it are this rank's, with their moments and gradient given as S-element
// arrays. The parameters' elements in that range are updated in place, the rest untouched (the padding past the
// last parameter has moments and a gradient but no parameter: skipped). One weight decay for the bucket.
// Inputs: n parameters (float32, whole), exp_avg [S], exp_avg_sq [S], gradient [S], hyper [9], decay [1],
// lo (int64 [1]); output float32 [1] (0). Returns 0; 1: an input not of its dtype; 2: sizes differ.
int AdamWSlice(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  const int n = nparam - 7;
  if (n < 1) return 2;
  for (int i = 0; i < nparam - 2; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  if (std::strcmp(dtypes[nparam - 2], "int64") != 0) return 1;
  auto size = [&](int i) { return elements(ndims[i], shapes[i]); };
  const int64_t slice = size(n);
  if (size(n + 1) != slice || size(n + 2) != slice || size(n + 4) != 1) return 2;
  Hyper h;
  std::memcpy(&h, params[n + 3], sizeof h);
  const float decay = *static_cast<const float *>(params[n + 4]);
  const int64_t lo = *static_cast<const int64_t *>(params[n + 5]), hi = lo + slice;
  *static_cast<float *>(params[nparam - 1]) = 0.0f;
  if (h.finite != 1.0f) return 0;
  float *m = static_cast<float *>(params[n]), *v = static_cast<float *>(params[n + 1]);
  const float *g = static_cast<const float *>(params[n + 2]);
  // the pieces of [lo, hi) that fall in a parameter: (parameter pointer, slice offset, length), end to end
  Tensors t;
  t.start.push_back(0);
  int64_t start = 0;
  for (int k = 0; k < n; ++k) {
    const int64_t s = size(k), a = std::max(lo, start), z = std::min(hi, start + s);
    if (z > a) {
      t.p.push_back(static_cast<float *>(params[k]) + (a - start));
      t.m.push_back(m + (a - lo));
      t.v.push_back(v + (a - lo));
      t.g.push_back(g + (a - lo));
      t.start.push_back(t.start.back() + (z - a));
    }
    start += s;
  }
  if (t.p.empty()) return 0;
  std::vector<float> decays(t.p.size(), decay);
  t.decay = decays.data();
  update_all(t, h);
  return 0;
}

}  // extern "C"
