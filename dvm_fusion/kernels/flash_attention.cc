// Blockwise causal attention with per-document masks on CPU (FlashAttention-2's algorithm), as MindSpore
// `ops.Custom` AOT kernels (dvm_fusion/flash_attention.py). No tensor of [queries, keys] scores exists: a query
// block's scores live one key block at a time in a thread's scratch.
//   FlashAttention:     (q [B, H, Sq, Dq], k [B, H, Sk, Dq], v [B, H, Sk, Dv], segment_ids [B, Sk] int32,
//                        positions [Sq] int32, hyper [2] = (scale, threads)) -> (out [B, H, Sq, Dv], lse [B, H, Sq])
//   FlashAttentionGrad: (q, k, v, segment_ids, positions, hyper, out, lse, dout) -> (dq, dk, dv)
// Query row i stands at key position positions[i] (the identity for ordinary attention; a context-parallel shard's
// rows are a subset of the sequence) and sees the keys [start of its document, positions[i]]: documents are the
// runs of equal segment ids. A query block reaches only the key range its rows see, so key blocks before the
// block's first document or after its last position are never computed: causal and per-document block skipping.
// The forward keeps a running row maximum and sum (online softmax) and returns the rows' log-sum-exp; the backward
// recomputes each block's probabilities from it, and the softmax correction is rowsum(dout * out).
// The forward's tasks are (sample, head, query block), the backward's (sample, head), each taken by the next free
// thread. float32 only (the binding casts other dtypes); error 1: dtypes; 3: a position outside [0, Sk).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "exp_poly.h"

namespace {

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 128;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct Dims {
  int64_t batch, heads, sq, sk, dq, dv;
};

// c[m, n] = (accumulate ? c : 0) + a[m, k] b[k, n], row-major b and c (leading dimensions ldb, ldc); a's element
// (i, p) at a[i * ars + p * acs], so that a transposed operand (p^T, ds^T in the backward) is read in place. R rows
// and W columns of c at a time stay in registers while k runs; what is left over goes row by row.
struct Matrix {
  const float *data;
  int64_t row_stride, col_stride;
  float at(int64_t i, int64_t p) const { return data[i * row_stride + p * col_stride]; }
};

template <int64_t R, int64_t W>
inline void gemm_tile(int64_t k, Matrix a, int64_t i, const float *b, int64_t ldb, float *c, int64_t ldc,
                      bool accumulate) {
  float t[R][W];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t w = 0; w < W; ++w) t[r][w] = accumulate ? c[r * ldc + w] : 0.0f;
  for (int64_t p = 0; p < k; ++p) {
    const float *bp = b + p * ldb;
    for (int64_t r = 0; r < R; ++r) {
      const float x = a.at(i + r, p);
      for (int64_t w = 0; w < W; ++w) t[r][w] += x * bp[w];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t w = 0; w < W; ++w) c[r * ldc + w] = t[r][w];
}

void gemm(int64_t m, int64_t n, int64_t k, Matrix a, const float *b, int64_t ldb, float *c, int64_t ldc,
          bool accumulate) {
  constexpr int64_t R = 4;
  const int64_t m4 = m - m % R, n32 = n - n % 32, n16 = n - n % 16;
  for (int64_t i = 0; i < m4; i += R) {
    for (int64_t j = 0; j < n32; j += 32) gemm_tile<R, 32>(k, a, i, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    if (n16 > n32) gemm_tile<R, 16>(k, a, i, b + n32, ldb, c + i * ldc + n32, ldc, accumulate);
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j0 = i < m4 ? n16 : 0;   // rows past m4 are done here whole; the others from column n16 on
    float *__restrict ci = c + i * ldc;
    if (!accumulate) std::memset(ci + j0, 0, sizeof(float) * (n - j0));
    for (int64_t p = 0; p < k; ++p) {
      const float x = a.at(i, p);
      const float *__restrict bp = b + p * ldb;
      for (int64_t j = j0; j < n; ++j) ci[j] += x * bp[j];
    }
  }
}

Matrix rows_of(const float *data, int64_t ld) { return {data, ld, 1}; }
Matrix transposed(const float *data, int64_t ld) { return {data, 1, ld}; }

// dst[c, r] = src[r, c] for r < rows, c < cols (dst's leading dimension ld).
void transpose(const float *src, int64_t rows, int64_t cols, int64_t lds, float *dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = src[r * lds + c];
}

// The position where each key's document starts, per sample: [B * Sk].
std::vector<int32_t> document_starts(const int32_t *seg, int64_t batch, int64_t sk) {
  std::vector<int32_t> start(batch * sk);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t *s = seg + b * sk;
    int32_t *out = start.data() + b * sk;
    for (int64_t j = 0; j < sk; ++j) out[j] = (j == 0 || s[j] != s[j - 1]) ? static_cast<int32_t>(j) : out[j - 1];
  }
  return start;
}

// A query block of this sample: its rows [i0, i0 + rows), the key range [lo, hi) they see, and per row the keys
// [first, last] it sees.
struct QueryBlock {
  int64_t i0, rows, lo, hi;
  std::vector<int64_t> first, last;

  QueryBlock(int64_t i0_, const Dims &d, const int32_t *pos, const int32_t *starts)
      : i0(i0_), rows(std::min(kQueryBlock, d.sq - i0_)), lo(d.sk), hi(0), first(rows), last(rows) {
    for (int64_t r = 0; r < rows; ++r) {
      last[r] = pos[i0 + r];
      first[r] = starts[last[r]];
      lo = std::min(lo, first[r]);
      hi = std::max(hi, last[r] + 1);
    }
  }

  // the columns [a, e) of row r visible in the key block starting at j0 of n keys (e <= a: none)
  int64_t begin(int64_t r, int64_t j0, int64_t n) const { return std::clamp<int64_t>(first[r] - j0, 0, n); }
  int64_t end(int64_t r, int64_t j0, int64_t n) const { return std::clamp<int64_t>(last[r] + 1 - j0, 0, n); }
};

// Runs task(t, worker) for t in [0, tasks) on up to `threads` threads, each task taken by the next free thread.
template <class Worker>
void run_tasks(int64_t tasks, int64_t threads, Worker make_worker) {
  threads = std::max<int64_t>(1, std::min(threads, tasks));
  std::atomic<int64_t> next{0};
  auto loop = [&] {
    auto worker = make_worker();
    for (int64_t t = next++; t < tasks; t = next++) worker(t);
  };
  std::vector<std::thread> others;
  for (int64_t i = 1; i < threads; ++i) others.emplace_back(loop);
  loop();
  for (auto &t : others) t.join();
}

bool float32_except(int nparam, const char **dtypes, int a, int b) {
  for (int i = 0; i < nparam; ++i)
    if (i != a && i != b && std::strcmp(dtypes[i], "float32") != 0) return false;
  return std::strcmp(dtypes[a], "int32") == 0 && std::strcmp(dtypes[b], "int32") == 0;
}

Dims dims_of(int64_t **shapes) {
  return {shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3], shapes[2][3]};
}

bool positions_fit(const int32_t *pos, const Dims &d) {
  for (int64_t i = 0; i < d.sq; ++i)
    if (pos[i] < 0 || pos[i] >= d.sk) return false;
  return true;
}

// Scratch of one thread: the scaled query block, the scores (then the probabilities, then their gradient), the
// output or dq accumulator, the running maximum and sum, the backward's dp, and a head's k^T (and v^T).
struct Scratch {
  std::vector<float> qs, s, acc, m, l, dp, kt, vt;
  Scratch(const Dims &d, bool backward)
      : qs(kQueryBlock * d.dq), s(kQueryBlock * kKeyBlock), acc(kQueryBlock * std::max(d.dq, d.dv)), m(kQueryBlock),
        l(kQueryBlock), dp(backward ? kQueryBlock * kKeyBlock : 0), kt(backward ? d.dq * d.sk : 0),
        vt(backward ? d.dv * d.sk : 0) {}
};

void scaled_queries(const float *q, const QueryBlock &qb, int64_t dq, float scale, float *qs) {
  for (int64_t i = 0; i < qb.rows * dq; ++i) qs[i] = q[qb.i0 * dq + i] * scale;
}

// Scores s = qs k^T of the key block [j0, j0 + n); kt is the head's k^T [dq, sk].
void block_scores(const float *qs, const float *kt, const QueryBlock &qb, int64_t j0, int64_t n, const Dims &d,
                  float *s) {
  gemm(qb.rows, n, d.dq, rows_of(qs, d.dq), kt + j0, d.sk, s, kKeyBlock, false);
}

void forward_block(const float *q, const float *kt, const float *v, const QueryBlock &qb, const Dims &d, float scale,
                   Scratch &w, float *out, float *lse) {
  scaled_queries(q, qb, d.dq, scale, w.qs.data());
  std::fill(w.m.begin(), w.m.end(), kMinusInf);
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  std::fill(w.acc.begin(), w.acc.begin() + qb.rows * d.dv, 0.0f);
  for (int64_t j0 = qb.lo; j0 < qb.hi; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, qb.hi - j0);
    block_scores(w.qs.data(), kt, qb, j0, n, d, w.s.data());
    for (int64_t r = 0; r < qb.rows; ++r) {
      float *__restrict row = w.s.data() + r * kKeyBlock;
      const int64_t a = qb.begin(r, j0, n), e = qb.end(r, j0, n);
      if (e <= a) {
        std::memset(row, 0, sizeof(float) * n);
        continue;
      }
      float top = w.m[r];
#pragma omp simd reduction(max : top)
      for (int64_t j = a; j < e; ++j) top = std::max(top, row[j]);
      const float alpha = std::exp(w.m[r] - top);   // 0 on the row's first visible block (m = -inf)
      float sum = 0.0f;
      std::memset(row, 0, sizeof(float) * a);
#pragma omp simd reduction(+ : sum)
      for (int64_t j = a; j < e; ++j) {
        row[j] = exp_poly(row[j] - top);
        sum += row[j];
      }
      std::memset(row + e, 0, sizeof(float) * (n - e));
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = top;
      float *acc = w.acc.data() + r * d.dv;
      for (int64_t c = 0; c < d.dv; ++c) acc[c] *= alpha;
    }
    gemm(qb.rows, d.dv, n, rows_of(w.s.data(), kKeyBlock), v + j0 * d.dv, d.dv, w.acc.data(), d.dv, true);
  }
  for (int64_t r = 0; r < qb.rows; ++r) {
    const float inv = 1.0f / w.l[r];
    for (int64_t c = 0; c < d.dv; ++c) out[(qb.i0 + r) * d.dv + c] = w.acc[r * d.dv + c] * inv;
    lse[qb.i0 + r] = w.m[r] + std::log(w.l[r]);
  }
}

// One (sample, head): dq, dk, dv from the recomputed probabilities p = exp(s - lse) block by block:
// dv += p^T dout, dp = dout v^T, ds = p (dp - rowsum(dout * out)), dq += ds k * scale, dk += ds^T (q * scale).
void backward_head(const float *q, const float *k, const float *v, const float *out, const float *lse,
                   const float *dout, const int32_t *pos, const int32_t *starts, const Dims &d, float scale,
                   Scratch &w, float *dq, float *dk, float *dv) {
  std::memset(dk, 0, sizeof(float) * d.sk * d.dq);
  std::memset(dv, 0, sizeof(float) * d.sk * d.dv);
  transpose(k, d.sk, d.dq, d.dq, w.kt.data(), d.sk);
  transpose(v, d.sk, d.dv, d.dv, w.vt.data(), d.sk);
  float delta[kQueryBlock];
  for (int64_t i0 = 0; i0 < d.sq; i0 += kQueryBlock) {
    const QueryBlock qb(i0, d, pos, starts);
    scaled_queries(q, qb, d.dq, scale, w.qs.data());
    const float *dout_b = dout + i0 * d.dv;
    for (int64_t r = 0; r < qb.rows; ++r) {
      float sum = 0.0f;
      for (int64_t c = 0; c < d.dv; ++c) sum += dout_b[r * d.dv + c] * out[(i0 + r) * d.dv + c];
      delta[r] = sum;
    }
    std::fill(w.acc.begin(), w.acc.begin() + qb.rows * d.dq, 0.0f);
    for (int64_t j0 = qb.lo; j0 < qb.hi; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, qb.hi - j0);
      block_scores(w.qs.data(), w.kt.data(), qb, j0, n, d, w.s.data());
      for (int64_t r = 0; r < qb.rows; ++r) {
        float *__restrict row = w.s.data() + r * kKeyBlock;
        const int64_t a = qb.begin(r, j0, n), e = std::max(a, qb.end(r, j0, n));
        const float top = lse[i0 + r];
        std::memset(row, 0, sizeof(float) * a);
#pragma omp simd
        for (int64_t j = a; j < e; ++j) row[j] = exp_poly(row[j] - top);
        std::memset(row + e, 0, sizeof(float) * (n - e));
      }
      gemm(n, d.dv, qb.rows, transposed(w.s.data(), kKeyBlock), dout_b, d.dv, dv + j0 * d.dv, d.dv, true);
      gemm(qb.rows, n, d.dv, rows_of(dout_b, d.dv), w.vt.data() + j0, d.sk, w.dp.data(), kKeyBlock, false);
      for (int64_t r = 0; r < qb.rows; ++r) {
        float *__restrict p = w.s.data() + r * kKeyBlock;
        const float *__restrict dp = w.dp.data() + r * kKeyBlock;
        for (int64_t j = 0; j < n; ++j) p[j] *= dp[j] - delta[r];                         // ds, in place of p
      }
      gemm(qb.rows, d.dq, n, rows_of(w.s.data(), kKeyBlock), k + j0 * d.dq, d.dq, w.acc.data(), d.dq, true);
      gemm(n, d.dq, qb.rows, transposed(w.s.data(), kKeyBlock), w.qs.data(), d.dq, dk + j0 * d.dq, d.dq, true);
    }
    for (int64_t i = 0; i < qb.rows * d.dq; ++i) dq[i0 * d.dq + i] = w.acc[i] * scale;
  }
}

}  // namespace

extern "C" {

int FlashAttention(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (nparam != 8 || !float32_except(nparam, dtypes, 3, 4)) return 1;
  const Dims d = dims_of(shapes);
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]), *hyper = static_cast<const float *>(params[5]);
  const int32_t *seg = static_cast<const int32_t *>(params[3]), *pos = static_cast<const int32_t *>(params[4]);
  float *out = static_cast<float *>(params[6]), *lse = static_cast<float *>(params[7]);
  if (!positions_fit(pos, d)) return 3;
  const std::vector<int32_t> starts = document_starts(seg, d.batch, d.sk);
  const int64_t blocks = (d.sq + kQueryBlock - 1) / kQueryBlock;
  std::vector<float> kt(d.batch * d.heads * d.dq * d.sk);   // each head's k^T [dq, sk], the scores' right operand
  for (int64_t bh = 0; bh < d.batch * d.heads; ++bh)
    transpose(k + bh * d.sk * d.dq, d.sk, d.dq, d.dq, kt.data() + bh * d.dq * d.sk, d.sk);
  run_tasks(d.batch * d.heads * blocks, static_cast<int64_t>(hyper[1]), [&] {
    return [&, w = Scratch(d, false)](int64_t t) mutable {
      const int64_t bh = t / blocks, b = bh / d.heads;
      const QueryBlock qb((t % blocks) * kQueryBlock, d, pos, starts.data() + b * d.sk);
      forward_block(q + bh * d.sq * d.dq, kt.data() + bh * d.dq * d.sk, v + bh * d.sk * d.dv, qb, d, hyper[0], w,
                    out + bh * d.sq * d.dv, lse + bh * d.sq);
    };
  });
  return 0;
}

int FlashAttentionGrad(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (nparam != 12 || !float32_except(nparam, dtypes, 3, 4)) return 1;
  const Dims d = dims_of(shapes);
  const float *q = static_cast<const float *>(params[0]), *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]), *hyper = static_cast<const float *>(params[5]);
  const int32_t *seg = static_cast<const int32_t *>(params[3]), *pos = static_cast<const int32_t *>(params[4]);
  const float *out = static_cast<const float *>(params[6]), *lse = static_cast<const float *>(params[7]);
  const float *dout = static_cast<const float *>(params[8]);
  float *dq = static_cast<float *>(params[9]), *dk = static_cast<float *>(params[10]);
  float *dv = static_cast<float *>(params[11]);
  if (!positions_fit(pos, d)) return 3;
  const std::vector<int32_t> starts = document_starts(seg, d.batch, d.sk);
  run_tasks(d.batch * d.heads, static_cast<int64_t>(hyper[1]), [&] {
    return [&, w = Scratch(d, true)](int64_t bh) mutable {
      const int64_t b = bh / d.heads;
      backward_head(q + bh * d.sq * d.dq, k + bh * d.sk * d.dq, v + bh * d.sk * d.dv, out + bh * d.sq * d.dv,
                    lse + bh * d.sq, dout + bh * d.sq * d.dv, pos, starts.data() + b * d.sk, d, hyper[0], w,
                    dq + bh * d.sq * d.dq, dk + bh * d.sk * d.dq, dv + bh * d.sk * d.dv);
    };
  });
  return 0;
}

}  // extern "C"
