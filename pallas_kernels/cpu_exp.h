// Vector math shared by the CPU kernels (the attention's softmax, the matmul's SwiGLU).

#ifndef JAXSERVE_CPU_EXP_H_
#define JAXSERVE_CPU_EXP_H_

#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// Functions of explicit 16-lane vector code only, with a * b + c contracted to fused
// multiply-adds where the CPU has them (the library is built with -ffp-contract=off): no
// loop here that the compiler could split into a vector body and a scalar remainder that
// rounds differently, so every row is still computed the same way wherever it falls.
#define JAXSERVE_FMA __attribute__((optimize("fp-contract=fast")))

namespace jaxserve {

// exp(x) lane-wise for x <= 0 (Cephes expf: Cody-Waite reduction + degree-6 polynomial,
// ~1 ulp), in vector arithmetic (V: 16 or 8 float lanes, I: as many int32 lanes): every
// lane is computed by the same operations.
template <typename V, typename I>
JAXSERVE_FMA inline V ExpNonPositiveGeneric(V x) {
  const V floor_at = V{} - 87.0f;
  x = x < floor_at ? floor_at : x;
  const V y = x * 1.44269504088896341f + 0.5f;
  const V t = __builtin_convertvector(__builtin_convertvector(y, I), V);  // toward zero
  const V n = t > y ? t - 1.0f : t;                                       // floor
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef __AVX512F__
// ExpNonPositiveGeneric on one AVX-512 register with the ISA's own floor (vrndscaleps) and
// times-2^n (vscalefps): the same operations on the same values in the same order, so
// bitwise the same results, in 17 instructions instead of 23
// (tests/test_attention_kernels.py sweeps every 16th float32 in [-100, 0]).
JAXSERVE_FMA inline __m512 ExpNonPositive512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(r, _mm512_mul_ps(p, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// ExpNonPositiveGeneric on one AVX2 register, in intrinsics: the same operations on the
// same values in the same order (its floor as vroundps, exact for these magnitudes; its
// clamp as vmaxps with the bound first, which keeps a NaN as the generic select does), so
// bitwise the same results. Written on GCC's vectors the callers' loads and stores went
// through the stack 16 bytes at a time (the softmax of a 500-token prefill's attention
// stalled on them).
JAXSERVE_FMA inline __m256 ExpNonPositive256(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 y = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(r, _mm256_mul_ps(p, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_EXP_H_
