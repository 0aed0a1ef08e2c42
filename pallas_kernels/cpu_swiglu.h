// SwiGLU's elementwise half for the fused gate|up call of the oneDNN linear layers:
// silu(g) * u over a row's values, every value computed alike, out as float32 or
// bfloat16 bits.
// Part of the oneDNN linear layers, cpu_matmul.cc (whose header comment says how they
// work), included there only.

#ifndef JAXSERVE_CPU_SWIGLU_H_
#define JAXSERVE_CPU_SWIGLU_H_

#include <cstdint>
#include <cstring>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/cpu_exp.h"

// Internal linkage, as when all of it was one file: included into cpu_matmul.cc alone.
namespace {

// silu(g) * u for n values of a row: g / (1 + exp(-g)) * u, exp taken of -|g| only (the
// sigmoid of a negative g as e / (1 + e)), 16 lanes at a time; a row's last, partial
// group goes through the same code from a padded copy, so every value is computed alike
// wherever it falls. Out: float32, or bfloat16 bits rounded to nearest even.
typedef float SwiGluLanes __attribute__((vector_size(64)));

JAXSERVE_FMA inline SwiGluLanes SwiGlu16(SwiGluLanes g, SwiGluLanes u) {
#ifdef __AVX512F__
  // AVX-512: the exp of cpu_exp.h, and 1 / (1 + e) as a reciprocal estimate refined by one
  // Newton step (~1 ulp; a division took as long as the rest).
  __m512 x, up;
  std::memcpy(&x, &g, sizeof x);
  std::memcpy(&up, &u, sizeof up);
  const __m512 e = jaxserve::ExpNonPositive512(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));  // exp(-|g|)
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
  const __m512 h = _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), up);
  SwiGluLanes out;
  std::memcpy(&out, &h, sizeof out);
  return out;
#else
  typedef int32_t I __attribute__((vector_size(64)));
  const SwiGluLanes e = jaxserve::ExpNonPositiveGeneric<SwiGluLanes, I>(g < 0 ? g : -g);
  return g * ((g < 0 ? e : SwiGluLanes{} + 1.0f) / (e + 1.0f)) * u;
#endif
}

// cpu_bf16.h's Bf16Bits on the float32 lanes at `x` (as many as U holds) at a time, into
// as many bfloat16 bits (U16).
typedef uint32_t Bits32x16 __attribute__((vector_size(64)));
typedef uint16_t Bits16x16 __attribute__((vector_size(32)));
typedef uint32_t Bits32x8 __attribute__((vector_size(32)));
typedef uint16_t Bits16x8 __attribute__((vector_size(16)));

template <typename U, typename U16>
inline void Bf16BitsLanes(const void* x, uint16_t* out) {
  U bits;
  std::memcpy(&bits, x, sizeof bits);
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U narrow = (bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded;  // NaN stays NaN
  const U16 out16 = __builtin_convertvector(narrow, U16);
  std::memcpy(out, &out16, sizeof out16);
}

inline void Store16(SwiGluLanes h, float* out) { std::memcpy(out, &h, sizeof h); }
inline void Store16(SwiGluLanes h, uint16_t* out) {
#ifdef __AVX512BF16__
  // The CPU's conversion: the same rounding in one instruction (a quarter of the reduction's
  // time was the generic code below), save that it flushes float32 subnormals to zero.
  __m512 x;
  std::memcpy(&x, &h, sizeof x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
#else
  Bf16BitsLanes<Bits32x16, Bits16x16>(&h, out);
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// SwiGlu16's generic code on one AVX2 register, in intrinsics: the same lane-wise
// operations (cpu_exp.h's exp, a true division), so bitwise the same values. GCC keeps
// 16-lane vectors in memory on AVX2, and the SwiGLU took ~10% of a 500-token prefill's
// gate-and-up product on a Zen 3.
JAXSERVE_FMA inline __m256 SwiGlu8(__m256 g, __m256 u) {
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = jaxserve::ExpNonPositive256(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), g, negative));
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), e, negative), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

inline void Store8(__m256 h, float* out) { _mm256_storeu_ps(out, h); }
inline void Store8(__m256 h, uint16_t* out) { Bf16BitsLanes<Bits32x8, Bits16x8>(&h, out); }
#endif

// JAXSERVE_FMA as SwiGlu16's: GCC inlines no function whose optimize attributes differ
// (without AVX-512 SwiGlu16 was a call per 16 values, its vectors passed in memory).
template <typename Out>
JAXSERVE_FMA void SwiGlu(const float* g, const float* u, Out* out, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) Store8(SwiGlu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)), out + i);
  if (i < n) {  // the same code on a padded copy
    float gp[8] = {}, up[8] = {};
    Out op[8];
    std::memcpy(gp, g + i, (n - i) * sizeof(float));
    std::memcpy(up, u + i, (n - i) * sizeof(float));
    Store8(SwiGlu8(_mm256_loadu_ps(gp), _mm256_loadu_ps(up)), op);
    std::memcpy(out + i, op, (n - i) * sizeof(Out));
  }
#else
  SwiGluLanes gv, uv;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    std::memcpy(&gv, g + j, sizeof gv);
    std::memcpy(&uv, u + j, sizeof uv);
    Store16(SwiGlu16(gv, uv), out + j);
  }
  if (j < n) {  // the same code on a padded copy
    float gp[16] = {}, up[16] = {};
    Out op[16];
    std::memcpy(gp, g + j, (n - j) * sizeof(float));
    std::memcpy(up, u + j, (n - j) * sizeof(float));
    std::memcpy(&gv, gp, sizeof gv);
    std::memcpy(&uv, up, sizeof uv);
    Store16(SwiGlu16(gv, uv), op);
    std::memcpy(out + j, op, (n - j) * sizeof(Out));
  }
#endif
}

}  // namespace

#endif  // JAXSERVE_CPU_SWIGLU_H_
