// The gradient norm's squares on CPU as one MindSpore `ops.Custom` AOT kernel (dvm_fusion/square_sums.py): the sum
// of squares of each of n float32 tensors, into one float32 [n] output, in one pass over each. MindSpore's
// composition costs a Square, two ReduceSums, a Mul and an Add per tensor (300 kernels a step on tiny, each with
// the runtime's gap after it). Each sum is accumulated in double over blocks of float32 lanes, so the result is
// closer to the exact sum than a float32 ReduceSum's.
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;

double square_sum(const float *__restrict x, int64_t n) {
  float lanes[kLanes] = {};
  double total = 0.0;
  int64_t i = 0;
  // float32 lanes over blocks of 4096 elements (vectorized), folded into double after each block
  for (; i + kLanes <= n;) {
    const int64_t end = i + 4096 < n ? i + 4096 : n - (n - i) % kLanes;
    for (; i < end; i += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * x[i + l];
    for (int64_t l = 0; l < kLanes; ++l) {
      total += lanes[l];
      lanes[l] = 0.0f;
    }
  }
  for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

}  // namespace

extern "C" {

// 0 on success; 1: an input or the output not float32.
int SquareSums(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  float *out = static_cast<float *>(params[nparam - 1]);
  for (int t = 0; t < nparam - 1; ++t) {
    int64_t n = 1;
    for (int d = 0; d < ndims[t]; ++d) n *= shapes[t][d];
    out[t] = static_cast<float>(square_sum(static_cast<const float *>(params[t]), n));
  }
  return 0;
}

}  // extern "C"
