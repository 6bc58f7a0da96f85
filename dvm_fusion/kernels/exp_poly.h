// exp_poly: the CPU kernels' vectorizable exp (rowwise.cc, flash_attention.cc). A header's text is part of the
// hash that names each built library (dvm_fusion/native.py), so editing it rebuilds the kernels that include it.
#pragma once

#include <cstdint>

// exp as a polynomial on the reduced argument times 2^n, branch-free so that the compiler vectorizes the row loops
// (libm's expf is a call per element: the SwiGLU kernel ran at 5 ns an element). Relative error about 1e-7 on
// [-87, 88]; arguments past that saturate to exp(-87.3) or exp(88.3); NaN stays NaN.
inline float exp_poly(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float t = x * 1.44269504f;                               // x = n ln 2 + r, |r| <= ln 2 / 2: n rounded
  const int32_t k = static_cast<int32_t>(t + (t < 0.0f ? -0.5f : 0.5f));   // by a cast (floor blocks vectorizing)
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;     // ln 2 in two parts, so r keeps its low bits
  float p = 1.9875691500e-4f;                                    // exp(r) by its minimax polynomial (Cephes)
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (k + 127) << 23);        // times 2^n
}
