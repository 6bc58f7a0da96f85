// Row-wise chains of small operators as MindSpore `ops.Custom` AOT kernels on CPU (dvm_fusion/rowwise.py), each one
// pass over the rows instead of five to ten kernels: MindSpore's CPU runtime spends tens of microseconds between any
// two kernels, and its broadcast Mul ran the combine's [rows, hidden] x [rows, 1] product at a third of memory speed.
//   SwigluPacked:        act [N, I] = silu(gate) * up, gate_up [N, 2I] holding gate | up per row (the experts'
//                        fused first GEMM), so the two halves are never sliced out
//   SwigluPackedGrad:    (gate_up, dact) -> d gate_up [N, 2I]
//   Swiglu:              act = silu(gate) * up from gate and up apart (the dense FFN, the shared expert)
//   SwigluGrad:          (gate, up, dact) -> (d gate, d up)
//   RmsNorm:             y [N, h] = w * x / sqrt(mean(x^2 over the row) + eps), eps a float32 [1] input
//   RmsNormGrad:         (x, w, eps, dy) -> (dx [N, h], dw [h])
//   BiasSoftmax:         probs = softmax(scores * scale + bias) over the last axis; scores [b, heads, s, t], bias
//                        [b, 1, s, t] (attention's document mask), scale a float32 [1] input
//   BiasSoftmaxGrad:     (probs, dprobs, scale) -> d scores = scale * probs * (dprobs - sum(probs * dprobs))
//   Rope:                y [b, H, s, d] = x * cos + rotate_half(x) * sin, rotate_half(x1 | x2) = -x2 | x1 over the
//                        halves of d; cos, sin [b, 1, s, d] (one table row per position, shared by the heads)
//   RopeGrad:            (dy, cos, sin) -> dx = dy * cos + (dy2 * sin2 | -dy1 * sin1), rotate_half's transpose
//   CrossEntropy:        nll [N] = mask * (logsumexp(logits row) - logits[label]), logits [N, V], labels [N] int32,
//                        mask [N]; a masked-out row's label is not read
//   CrossEntropyGrad:    (logits, labels, mask, dnll) -> dlogits = dnll * mask * (softmax(row) - onehot(label))
//   WeightedCombine:     out [T, h]: out[token[r]] += weight[r] * y[r] over the rows r of y [R, h] (dispatch
//                        order), zero for a token no row names; T = R / top_k, given by the output's shape
//   WeightedCombineGrad: (dout [T, h], y, weight [R], token [R]) -> (dy [R, h] = weight[r] * dout[token[r]],
//                        dweight [R] = <dout[token[r]], y[r]>)
// float32 only (the binding casts other dtypes); a token id outside [0, T) or a counted label outside [0, V) stops
// the kernel (error 3) instead of reaching past the buffers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_poly.h"

namespace {

bool all_float32(int nparam, const char **dtypes, int skip) {
  for (int i = 0; i < nparam; ++i)
    if (i != skip && std::strcmp(dtypes[i], "float32") != 0) return false;
  return true;
}

int64_t elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

// act = silu(g) u over a row's n elements, and its backward: d/du = silu(g), d/dg = u silu'(g),
// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g)
inline void swiglu_row(const float *__restrict g, const float *__restrict u, float *__restrict a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) a[j] = g[j] * sigmoid(g[j]) * u[j];
}

inline void swiglu_row_grad(const float *__restrict g, const float *__restrict u, const float *__restrict d,
                            float *__restrict dg, float *__restrict du, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = sigmoid(g[j]);
    du[j] = d[j] * g[j] * s;
    dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
  }
}

bool tokens_fit(const int32_t *token, int64_t rows, int64_t tokens) {
  for (int64_t r = 0; r < rows; ++r)
    if (token[r] < 0 || token[r] >= tokens) return false;
  return true;
}

// x [b, H, s, d] against tables [b or 1, 1, s, d]: `row(x row, cos row, sin row, out row, d / 2)` for every row;
// false (and nothing done) for other shapes
template <class Row>
bool rope_rows(int nparam, void **params, int *ndims, int64_t **shapes, Row row) {
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4) return false;
  const int64_t batch = shapes[0][0], heads = shapes[0][1], rows = shapes[0][2], d = shapes[0][3];
  const int64_t tables = shapes[1][0];
  for (int i = 1; i < 3; ++i)
    if (shapes[i][0] != tables || shapes[i][1] != 1 || shapes[i][2] != rows || shapes[i][3] != d) return false;
  if ((tables != batch && tables != 1) || d % 2 != 0) return false;
  const float *x = static_cast<const float *>(params[0]), *cos = static_cast<const float *>(params[1]);
  const float *sin = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[nparam - 1]);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hd = 0; hd < heads; ++hd)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = ((b * heads + hd) * rows + r) * d, table = ((tables == 1 ? 0 : b) * rows + r) * d;
        row(x + at, cos + table, sin + table, out + at, d / 2);
      }
  return true;
}

}  // namespace

extern "C" {

// 0 on success; 1: not float32 data (or token ids not int32); 3: a token id outside [0, T).
int SwigluPacked(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *gate_up = static_cast<const float *>(params[0]);
  float *act = static_cast<float *>(params[1]);
  const int64_t rows = shapes[0][0], width = shapes[0][1] / 2;
  for (int64_t r = 0; r < rows; ++r)
    swiglu_row(gate_up + r * 2 * width, gate_up + r * 2 * width + width, act + r * width, width);
  return 0;
}

int SwigluPackedGrad(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *gate_up = static_cast<const float *>(params[0]), *dact = static_cast<const float *>(params[1]);
  float *dgate_up = static_cast<float *>(params[2]);
  const int64_t rows = shapes[0][0], width = shapes[0][1] / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gate_up + r * 2 * width;
    float *dg = dgate_up + r * 2 * width;
    swiglu_row_grad(g, g + width, dact + r * width, dg, dg + width, width);
  }
  return 0;
}

// gate and up of the same shape, any rank: one row of all their elements
int Swiglu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  swiglu_row(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
             static_cast<float *>(params[2]), elements(ndims[0], shapes[0]));
  return 0;
}

int SwigluGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  swiglu_row_grad(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                  static_cast<const float *>(params[2]), static_cast<float *>(params[3]),
                  static_cast<float *>(params[4]), elements(ndims[0], shapes[0]));
  return 0;
}

inline float row_rstd(const float *__restrict x, int64_t h, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < h; ++j) sum += x[j] * x[j];
  return 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
}

int RmsNorm(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], h = shapes[0][1];
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict xr = x + r * h;
    float *__restrict yr = y + r * h;
    const float rstd = row_rstd(xr, h, eps);
    for (int64_t j = 0; j < h; ++j) yr[j] = w[j] * (xr[j] * rstd);
  }
  return 0;
}

// y_j = w_j x_j r with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / h:
//   dx_j = r w_j dy_j - x_j (r^3 / h) sum_i w_i dy_i x_i,   dw_j = sum over rows of dy_j x_j r
int RmsNormGrad(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]), *__restrict dw = static_cast<float *>(params[5]);
  const int64_t rows = shapes[0][0], h = shapes[0][1];
  std::memset(dw, 0, sizeof(float) * h);
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict xr = x + r * h, *__restrict dyr = dy + r * h;
    float *__restrict dxr = dx + r * h;
    const float rstd = row_rstd(xr, h, eps);
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < h; ++j) dot += w[j] * dyr[j] * xr[j];
    const float c = rstd * rstd * rstd * dot / static_cast<float>(h);
    for (int64_t j = 0; j < h; ++j) {
      dxr[j] = rstd * w[j] * dyr[j] - xr[j] * c;
      dw[j] += dyr[j] * xr[j] * rstd;
    }
  }
  return 0;
}

int BiasSoftmax(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *scores = static_cast<const float *>(params[0]), *bias = static_cast<const float *>(params[1]);
  const float scale = *static_cast<const float *>(params[2]);
  float *probs = static_cast<float *>(params[3]);
  const int64_t batch = shapes[0][0], heads = shapes[0][1], rows = shapes[0][2], cols = shapes[0][3];
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hd = 0; hd < heads; ++hd)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = ((b * heads + hd) * rows + r) * cols;
        const float *__restrict x = scores + at, *__restrict m = bias + (b * rows + r) * cols;
        float *__restrict p = probs + at;
        float top = -3.0e38f;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < cols; ++j) {
          p[j] = x[j] * scale + m[j];
          top = p[j] > top ? p[j] : top;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < cols; ++j) {
          p[j] = exp_poly(p[j] - top);
          sum += p[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < cols; ++j) p[j] *= inv;
      }
  return 0;
}

int BiasSoftmaxGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const float *probs = static_cast<const float *>(params[0]), *dprobs = static_cast<const float *>(params[1]);
  const float scale = *static_cast<const float *>(params[2]);
  float *dscores = static_cast<float *>(params[3]);
  const int64_t cols = shapes[0][ndims[0] - 1];
  int64_t rows = 1;
  for (int d = 0; d + 1 < ndims[0]; ++d) rows *= shapes[0][d];
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict p = probs + r * cols, *__restrict d = dprobs + r * cols;
    float *__restrict out = dscores + r * cols;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < cols; ++j) dot += p[j] * d[j];
    for (int64_t j = 0; j < cols; ++j) out[j] = scale * p[j] * (d[j] - dot);
  }
  return 0;
}

// 0 on success; 1: not float32; 2: shapes that are not x [b, H, s, d] (d even) with tables [b or 1, 1, s, d]
int Rope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const bool fit = rope_rows(nparam, params, ndims, shapes, [](const float *__restrict x, const float *__restrict c,
                                       const float *__restrict s, float *__restrict y, int64_t half) {
    for (int64_t j = 0; j < half; ++j) {
      y[j] = x[j] * c[j] - x[j + half] * s[j];
      y[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
    }
  });
  return fit ? 0 : 2;
}

int RopeGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, -1)) return 1;
  const bool fit = rope_rows(nparam, params, ndims, shapes, [](const float *__restrict dy, const float *__restrict c,
                                       const float *__restrict s, float *__restrict dx, int64_t half) {
    for (int64_t j = 0; j < half; ++j) {
      dx[j] = dy[j] * c[j] + dy[j + half] * s[j + half];
      dx[j + half] = dy[j + half] * c[j + half] - dy[j] * s[j];
    }
  });
  return fit ? 0 : 2;
}

// max and sum of exp(x - max) of a row: its logsumexp is max + log(sum)
inline float row_logsumexp(const float *__restrict x, int64_t n) {
  float top = -3.0e38f;
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < n; ++j) top = x[j] > top ? x[j] : top;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += exp_poly(x[j] - top);
  return top + std::log(sum);
}

bool labels_fit(const int32_t *labels, const float *mask, int64_t rows, int64_t classes) {
  for (int64_t r = 0; r < rows; ++r)
    if (mask[r] != 0.0f && (labels[r] < 0 || labels[r] >= classes)) return false;
  return true;
}

int CrossEntropy(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, 1) || std::strcmp(dtypes[1], "int32") != 0) return 1;
  const float *logits = static_cast<const float *>(params[0]);
  const int32_t *labels = static_cast<const int32_t *>(params[1]);
  const float *mask = static_cast<const float *>(params[2]);
  float *nll = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], classes = shapes[0][1];
  if (!labels_fit(labels, mask, rows, classes)) return 3;
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * classes;
    nll[r] = mask[r] == 0.0f ? 0.0f : mask[r] * (row_logsumexp(x, classes) - x[labels[r]]);
  }
  return 0;
}

int CrossEntropyGrad(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, 1) || std::strcmp(dtypes[1], "int32") != 0) return 1;
  const float *logits = static_cast<const float *>(params[0]);
  const int32_t *labels = static_cast<const int32_t *>(params[1]);
  const float *mask = static_cast<const float *>(params[2]), *dnll = static_cast<const float *>(params[3]);
  float *dlogits = static_cast<float *>(params[4]);
  const int64_t rows = shapes[0][0], classes = shapes[0][1];
  if (!labels_fit(labels, mask, rows, classes)) return 3;
  for (int64_t r = 0; r < rows; ++r) {
    const float *__restrict x = logits + r * classes;
    float *__restrict d = dlogits + r * classes;
    const float g = dnll[r] * mask[r];
    if (g == 0.0f) {
      std::memset(d, 0, sizeof(float) * classes);
      continue;
    }
    const float lse = row_logsumexp(x, classes);
    for (int64_t j = 0; j < classes; ++j) d[j] = g * exp_poly(x[j] - lse);
    d[labels[r]] -= g;
  }
  return 0;
}

int WeightedCombine(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, 2) || std::strcmp(dtypes[2], "int32") != 0) return 1;
  const float *y = static_cast<const float *>(params[0]), *weight = static_cast<const float *>(params[1]);
  const int32_t *token = static_cast<const int32_t *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], hidden = shapes[0][1], tokens = shapes[3][0];
  if (!tokens_fit(token, rows, tokens)) return 3;
  std::memset(out, 0, sizeof(float) * tokens * hidden);
  for (int64_t r = 0; r < rows; ++r) {
    const float w = weight[r], *src = y + r * hidden;
    float *dst = out + static_cast<int64_t>(token[r]) * hidden;
    for (int64_t j = 0; j < hidden; ++j) dst[j] += w * src[j];
  }
  return 0;
}

int WeightedCombineGrad(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (!all_float32(nparam, dtypes, 3) || std::strcmp(dtypes[3], "int32") != 0) return 1;
  const float *dout = static_cast<const float *>(params[0]), *y = static_cast<const float *>(params[1]);
  const float *weight = static_cast<const float *>(params[2]);
  const int32_t *token = static_cast<const int32_t *>(params[3]);
  float *dy = static_cast<float *>(params[4]), *dweight = static_cast<float *>(params[5]);
  const int64_t tokens = shapes[0][0], rows = shapes[1][0], hidden = shapes[1][1];
  if (!tokens_fit(token, rows, tokens)) return 3;
  for (int64_t r = 0; r < rows; ++r) {
    const float w = weight[r], *g = dout + static_cast<int64_t>(token[r]) * hidden, *src = y + r * hidden;
    float *d = dy + r * hidden, dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < hidden; ++j) {
      d[j] = w * g[j];
      dot += g[j] * src[j];
    }
    dweight[r] = dot;
  }
  return 0;
}

// Output shapes for MindSpore's C++ shape inference, as in grouped_matmul.cc: the experts' rows may be known only
// at run time (-1).
class AotExtra;
std::vector<int64_t> SwigluPackedInferShape(int *, int64_t **shapes, AotExtra *) {
  return {shapes[0][0], shapes[0][1] < 0 ? shapes[0][1] : shapes[0][1] / 2};
}

std::vector<int64_t> SwigluPackedGradInferShape(int *, int64_t **shapes, AotExtra *) {
  return {shapes[0][0], shapes[0][1]};
}

}  // extern "C"
