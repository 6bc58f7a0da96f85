// The MoE experts' grouped matmul on CPU, as MindSpore `ops.Custom` AOT kernels (dvm_fusion/grouped_matmul.py):
// rows of x sorted by expert, one weight matrix per expert, dropless, one BLAS GEMM per non-empty group.
//   GroupedMatmul:   y[rows of e]  = x[rows of e] @ w[e]        x [N, in], w [E, in, out], sizes [E] -> [N, out]
//   GroupedMatmulDx: dx[rows of e] = dy[rows of e] @ w[e]^T     dy [N, out], w [E, in, out], sizes -> [N, in]
//   GroupedMatmulDw: dw[e] = x[rows of e]^T @ dy[rows of e]     x [N, in], dy [N, out], sizes -> [E, in, out]
// Rows past the last group (an expert-parallel receive buffer's padding) come out zero, and so does the gradient
// of an expert that saw no row. An AOT kernel gets MindSpore's buffers as raw pointers: a pyfunc kernel costs a
// conversion of every input and output to and from NumPy on each call, and the GIL.
//
// The GEMMs are the OpenBLAS that NumPy loaded into this process (found among the loaded objects, so that both
// share one library and one thread setting); its 64-bit-integer interface is suffixed `64_`.
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
using Sgemm = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                       int64_t, float, float *, int64_t);

int find_openblas(dl_phdr_info *info, size_t, void *found) {
  if (info->dlpi_name && std::strstr(info->dlpi_name, "openblas")) {
    void *lib = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (lib) {
      *static_cast<void **>(found) = dlsym(lib, "cblas_sgemm64_");
      if (*static_cast<void **>(found)) return 1;
    }
  }
  return 0;
}

Sgemm sgemm() {
  static Sgemm fn = [] {
    void *found = nullptr;
    dl_iterate_phdr(find_openblas, &found);
    return reinterpret_cast<Sgemm>(found);
  }();
  return fn;
}

std::atomic<int64_t> busy_ns{0};

struct Timed {  // adds the kernel's wall time to busy_ns, for GroupedMatmulTakeSeconds
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~Timed() {
    busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
};

bool float32_io(int nparam, const char **dtypes) {
  return std::strcmp(dtypes[0], "float32") == 0 && std::strcmp(dtypes[1], "float32") == 0 &&
         std::strcmp(dtypes[nparam - 1], "float32") == 0 && std::strcmp(dtypes[2], "int32") == 0;
}

// Whether the groups fit in the rows (no negative size, their sum at most the rows): otherwise a GEMM would reach
// past the buffers.
bool groups_fit(const int32_t *sizes, int64_t experts, int64_t rows) {
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] < 0) return false;
    total += sizes[e];
  }
  return total <= rows;
}

// y[rows of e] = a[rows of e] @ w[e] (or @ w[e]^T): a [N, k], w [E, in, out], sizes [E] -> y [N, n]; the forward
// (a = x, k = in, n = out) and dx (a = dy, k = out, n = in, transposed) are this one loop.
int row_groups(int nparam, void **params, int64_t **shapes, const char **dtypes, bool transpose_w) {
  if (!float32_io(nparam, dtypes)) return 1;
  Sgemm gemm = sgemm();
  if (!gemm) return 2;
  const float *a = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const int32_t *sizes = static_cast<const int32_t *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], k = shapes[0][1], experts = shapes[1][0], ldw = shapes[1][2];
  const int64_t n = transpose_w ? shapes[1][1] : shapes[1][2], stride = shapes[1][1] * shapes[1][2];
  if (!groups_fit(sizes, experts, rows)) return 3;
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] > 0)
      gemm(kRowMajor, kNoTrans, transpose_w ? kTrans : kNoTrans, sizes[e], n, k, 1.0f, a + at * k, k, w + e * stride,
           ldw, 0.0f, y + at * n, n);
    at += sizes[e];
  }
  std::memset(y + at * n, 0, sizeof(float) * (rows - at) * n);
  return 0;
}

}  // namespace

extern "C" {

// 0 on success; 1: not float32 inputs with int32 group sizes; 2: NumPy's OpenBLAS is not loaded in this process;
// 3: group sizes that do not fit in the rows.
int GroupedMatmul(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  Timed timed;
  return row_groups(nparam, params, shapes, dtypes, false);
}

int GroupedMatmulDx(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  Timed timed;
  return row_groups(nparam, params, shapes, dtypes, true);
}

int GroupedMatmulDw(int nparam, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  Timed timed;
  if (!float32_io(nparam, dtypes)) return 1;
  Sgemm gemm = sgemm();
  if (!gemm) return 2;
  const float *x = static_cast<const float *>(params[0]), *dy = static_cast<const float *>(params[1]);
  const int32_t *sizes = static_cast<const int32_t *>(params[2]);
  float *dw = static_cast<float *>(params[3]);
  const int64_t in = shapes[0][1], out = shapes[1][1], experts = shapes[2][0];
  if (!groups_fit(sizes, experts, shapes[0][0])) return 3;
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] > 0)
      gemm(kRowMajor, kTrans, kNoTrans, in, out, sizes[e], 1.0f, x + at * in, in, dy + at * out, out, 0.0f,
           dw + e * in * out, out);
    else
      std::memset(dw + e * in * out, 0, sizeof(float) * in * out);
    at += sizes[e];
  }
  return 0;
}

// Seconds spent inside the three kernels since the last call (dvm_fusion.grouped_matmul.KERNEL_CLOCK).
double GroupedMatmulTakeSeconds() { return busy_ns.exchange(0) * 1e-9; }

// Output shapes, for MindSpore's C++ shape inference (`out_shape=None` in grouped_matmul.py): the exact expert
// exchange gives the experts a row count known only at run time (-1 here), which a Python `out_shape` cannot take.
class AotExtra;
std::vector<int64_t> GroupedMatmulInferShape(int *, int64_t **shapes, AotExtra *) { return {shapes[0][0], shapes[1][2]}; }

std::vector<int64_t> GroupedMatmulDxInferShape(int *, int64_t **shapes, AotExtra *) {
  return {shapes[0][0], shapes[1][1]};
}

std::vector<int64_t> GroupedMatmulDwInferShape(int *, int64_t **shapes, AotExtra *) {
  return {shapes[2][0], shapes[0][1], shapes[1][1]};
}

}  // extern "C"
