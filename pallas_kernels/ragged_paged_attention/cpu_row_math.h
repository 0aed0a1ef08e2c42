// One query row's arithmetic in the CPU attention kernel, on 16-lane vectors: its scores
// against a group of 16 keys (per row, or for many rows against the keys transposed),
// its exact softmax, and p * V, each sum in an order fixed by the row alone, which is what
// makes a token's output the same bits however it was batched. Without AVX-512 the same
// arithmetic on 8-lane halves.
// Part of the CPU attention kernel, cpu_kernel.cc (whose header comment states the
// contract), included there only.

#ifndef JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_ROW_MATH_H_
#define JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_ROW_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/cpu_exp.h"
#include "pallas_kernels/ragged_paged_attention/cpu_tile.h"

// Internal linkage, as when all of it was one file: these headers are included into
// cpu_kernel.cc alone.
namespace {

// Sum of 16 lanes, always by the same tree: halves added lane-wise, 16 -> 8 -> 4 -> 2 -> 1
// (SumLanes8 after the first level, which each softmax adds its own way).

template <typename Half, typename Whole>
inline Half AddHalves(const Whole& v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lo + hi;
}

inline float SumLanes8(Lanes8 v) {
  const Lanes4 v4 = AddHalves<Lanes4>(v);
  const float v2[2] = {v4[0] + v4[2], v4[1] + v4[3]};
  return v2[0] + v2[1];
}

template <typename V = Lanes, typename I = Ints>
JAXSERVE_FMA inline V ExpNonPositive(V x) {
  return jaxserve::ExpNonPositiveGeneric<V, I>(x);
}

#ifdef __AVX512F__
// The softmax's exp on AVX-512 (cpu_exp.h; bitwise the generic code): a 500-token
// prefill's softmax is ~40% of its attention.
template <>
JAXSERVE_FMA inline Lanes ExpNonPositive<Lanes, Ints>(Lanes v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  const __m512 e = jaxserve::ExpNonPositive512(x);
  Lanes out;
  std::memcpy(&out, &e, sizeof out);
  return out;
}
#endif

// Scores of one row against 16 consecutive keys from their 16-lane partial sums: a fixed
// butterfly (halves of pairs added lane-wise, 16 -> 8 -> 4 -> 2 -> 1 lanes per key) that
// leaves key k's sum in lane k. ~3 operations per score where a horizontal sum per key
// took ~8. Which tree sums a key's lanes depends only on the key's place in its group,
// and groups start at multiples of 16 positions, so the score is the row's own.
inline Lanes Reduce16(const Lanes* acc) {
  // Inputs in bit-reversed order come out in natural order.
  static constexpr int kRev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Lanes w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    const Lanes a = acc[kRev[2 * i]], b = acc[kRev[2 * i + 1]];
    w[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const Lanes a = w[2 * i], b = w[2 * i + 1];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const Lanes a = x[2 * i], b = x[2 * i + 1];
    y[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Without AVX-512, GCC compiles 16-lane vectors held in arrays badly (each moved through
// general registers 8 bytes at a time: a decode step's attention took 2.7x as long on a
// Zen 2), so the hot functions (softmax, scores, p * V) work on 8-lane halves there, one
// AVX2 register each, with the very same lane-wise arithmetic: the results are bitwise
// those of the 16-lane code. (Lanes8: cpu_tile.h.)
typedef int32_t Ints8 __attribute__((vector_size(8 * sizeof(int32_t))));

inline Lanes8 Half(const float* p) {
  Lanes8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// SoftmaxRow (below) on halves, in place (without AVX-512 only the tile runner's
// float32 softmax calls it): the same lane-wise operations, the same maximum (exact in
// any order) and the same tree for the sum (its halves added, then SumLanes8).
JAXSERVE_FMA inline float SoftmaxRowHalves(float* s, int32_t base, int32_t lo, int32_t pos) {
  const int32_t g_lo = (lo - base) / kLanes, g_hi = (pos - base) / kLanes;
#if defined(__AVX2__) && defined(__FMA__)
  // In intrinsics: on GCC's vectors each half went through the stack 16 bytes at a time
  // on its way in and out (the 32-byte load after two 16-byte stores waiting on them),
  // and the softmax was ~30% of a 500-token prefill's attention on a Zen 3.
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  // Lanes of the 8 positions from `first` inside [lo, pos] (all ones), as a float mask.
  auto visible = [&](int32_t first) {
    const __m256i p = _mm256_add_epi32(iota, _mm256_set1_epi32(first));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), p), above = _mm256_cmpgt_epi32(p, _mm256_set1_epi32(pos));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(below, above), _mm256_set1_epi32(-1)));
  };
  __m256 mv = minus_inf;
  for (int32_t g = g_lo; g <= g_hi; ++g) {
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_loadu_ps(s + g * kLanes + 8 * h);
      if (g == g_lo || g == g_hi) v = _mm256_blendv_ps(minus_inf, v, visible(base + g * kLanes + 8 * h));
      mv = _mm256_max_ps(mv, v);  // mv > v ? mv : v
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int32_t g = g_lo; g <= g_hi; ++g) {
    for (int h = 0; h < 2; ++h) {
      float* at = s + g * kLanes + 8 * h;
      __m256 v = jaxserve::ExpNonPositive256(_mm256_sub_ps(_mm256_loadu_ps(at), mb));
      if (g == g_lo || g == g_hi) v = _mm256_and_ps(v, visible(base + g * kLanes + 8 * h));
      _mm256_storeu_ps(at, v);
      sum[h] = _mm256_add_ps(sum[h], v);
    }
  }
  Lanes8 total;
  const __m256 both = _mm256_add_ps(sum[0], sum[1]);
  std::memcpy(&total, &both, sizeof total);
  return SumLanes8(total);
#else
  Ints8 iota;
  for (int i = 0; i < 8; ++i) iota[i] = i;
  const Lanes8 minus_inf = Lanes8{} - INFINITY;
  auto visible = [&](int32_t first) { return ((iota + first) >= lo) & ((iota + first) <= pos); };
  Lanes8 mv = minus_inf;
  for (int32_t g = g_lo; g <= g_hi; ++g) {
    const int32_t first = base + g * kLanes;
    for (int h = 0; h < 2; ++h) {
      Lanes8 v = Half(s + g * kLanes + 8 * h);
      if (g == g_lo || g == g_hi) v = visible(first + 8 * h) ? v : minus_inf;
      mv = mv > v ? mv : v;
    }
  }
  float m = mv[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, mv[i]);
  Lanes8 sum[2] = {};
  for (int32_t g = g_lo; g <= g_hi; ++g) {
    const int32_t first = base + g * kLanes;
    for (int h = 0; h < 2; ++h) {
      Lanes8 v = ExpNonPositive<Lanes8, Ints8>(Half(s + g * kLanes + 8 * h) - m);
      if (g == g_lo || g == g_hi) v = visible(first + 8 * h) ? v : Lanes8{};
      std::memcpy(s + g * kLanes + 8 * h, &v, sizeof v);
      sum[h] += v;
    }
  }
  return SumLanes8(sum[0] + sum[1]);
#endif
}

// Softmax of one row over its own positions [lo, pos], exactly (two passes, no online
// rescaling), a group of 16 at a time: position j is lane j % 16 of the row's partial sums,
// whatever the tile. s holds the row's scores from position base (a multiple of 16) on.
// Each group that [lo, pos] touches goes to store(g, probabilities), 0 outside [lo, pos]
// (so the p * V step adds nothing for them). Returns the sum of the probabilities.
// With AVX-512 only (the AMX runner's store splits each group into bfloat16 halves);
// elsewhere SoftmaxRowHalves, in place.
#ifdef __AVX512F__
template <typename Store>
JAXSERVE_FMA inline float SoftmaxRow(const float* s, int32_t base, int32_t lo, int32_t pos, Store&& store) {
  // In intrinsics, the store taken by value: written on GCC's vectors, the running sum
  // lived on the stack (each group's add waited for the last one's store) and the store's
  // pointers were reloaded from its closure every group. Bitwise the same results; a
  // 500-token SmolLM2 prefill's attention without AMX 44.9-46.4 ms against 46.1-48.2
  // (30 layers, 2-core Xeon, scripts/bench_attention.py).
  std::decay_t<Store> put = store;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lo_v = _mm512_set1_epi32(lo), pos_v = _mm512_set1_epi32(pos);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  const int32_t g_lo = (lo - base) / kLanes, g_hi = (pos - base) / kLanes;
  // Only the first and last groups can hold positions outside [lo, pos].
  auto visible = [&](int32_t g) -> __mmask16 {
    const __m512i p = _mm512_add_epi32(iota, _mm512_set1_epi32(base + g * kLanes));
    return _mm512_cmpge_epi32_mask(p, lo_v) & _mm512_cmple_epi32_mask(p, pos_v);
  };
  __m512 mv = minus_inf;
  for (int32_t g = g_lo; g <= g_hi; ++g) {
    __m512 v = _mm512_loadu_ps(s + g * kLanes);
    if (g == g_lo || g == g_hi) v = _mm512_mask_mov_ps(minus_inf, visible(g), v);
    mv = _mm512_max_ps(mv, v);
  }
  // The largest lane by a tree (a maximum is exact in any order; a zero's sign, the only
  // thing the order could change, does not change v - m).
  __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(mv), _mm512_extractf32x8_ps(mv, 1));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m512 m = _mm512_broadcastss_ps(m4);
  // The edge groups (masked) apart from the loop between them, which then tests no mask;
  // the sum still in group order. (One loop testing for the edges: 45.6-50.4 ms against
  // 44.9-46.9 for the bench above, 6 interleaved rounds.)
  auto group = [&](int32_t g, __mmask16 keep) {
    const __m512 v = _mm512_maskz_mov_ps(keep, jaxserve::ExpNonPositive512(_mm512_sub_ps(_mm512_loadu_ps(s + g * kLanes), m)));
    Lanes p;
    std::memcpy(&p, &v, sizeof p);
    put(g, p);
    return v;
  };
  __m512 sum = group(g_lo, visible(g_lo));
  for (int32_t g = g_lo + 1; g < g_hi; ++g) sum = _mm512_add_ps(sum, group(g, 0xffff));
  if (g_hi > g_lo) sum = _mm512_add_ps(sum, group(g_hi, visible(g_hi)));
  // The sum's tree (halves added, then SumLanes8), its first level in registers: halves
  // taken through memory (AddHalves) are what kept the running sum there.
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
  Lanes8 total;
  std::memcpy(&total, &half, sizeof total);
  return SumLanes8(total);
}
#endif


// Reduce16's levels 2-4 on one 8-lane half (Reduce16's 16-lane shuffles never cross the
// halves): each adds the same lanes Reduce16 adds.
inline Lanes8 Level2(Lanes8 a, Lanes8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline Lanes8 Level3(Lanes8 a, Lanes8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
inline Lanes8 Level4(Lanes8 a, Lanes8 b) {
  return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

// Reduce16 on halves: acc[j] is key j's 16 partial sums as lo (lanes 0-7) and hi (8-15);
// out gets the 16 scores. Level 1 adds each key's hi half to its lo half.
inline void Reduce16Halves(const Lanes8* lo, const Lanes8* hi, float* out) {
  static constexpr int kRev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  Lanes8 w[2][8], x[2][4], y[2][2];  // [lo / hi half of the result][...]
  for (int i = 0; i < 8; ++i) {
    const int a = kRev[2 * i], b = kRev[2 * i + 1];
    w[0][i] = lo[a] + hi[a];
    w[1][i] = lo[b] + hi[b];
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) x[h][i] = Level2(w[h][2 * i], w[h][2 * i + 1]);
    for (int i = 0; i < 2; ++i) y[h][i] = Level3(x[h][2 * i], x[h][2 * i + 1]);
    const Lanes8 o = Level4(y[h][0], y[h][1]);
    std::memcpy(out + 8 * h, &o, sizeof o);
  }
}

// 16 scores of one row into out: keys [16][chunks] against the row's scaled query [chunks].
template <int C>
JAXSERVE_FMA inline void GroupScores(const Lanes* q, const Lanes* keys, int64_t chunks, float* out) {
  const int64_t n = C > 0 ? C : chunks;
#ifndef __AVX512F__
  const float* qf = reinterpret_cast<const float*>(q);
  const float* kf = reinterpret_cast<const float*>(keys);
  Lanes8 lo[kLanes], hi[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const float* k = kf + j * n * kLanes;
    Lanes8 a = Half(qf) * Half(k), b = Half(qf + 8) * Half(k + 8);
    for (int64_t c = 1; c < n; ++c) {
      a = Half(qf + c * kLanes) * Half(k + c * kLanes) + a;
      b = Half(qf + c * kLanes + 8) * Half(k + c * kLanes + 8) + b;
    }
    lo[j] = a;
    hi[j] = b;
  }
  Reduce16Halves(lo, hi, out);
#else
  Lanes acc[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const Lanes* k = keys + j * n;
    Lanes a = q[0] * k[0];
    for (int64_t c = 1; c < n; ++c) a = q[c] * k[c] + a;
    acc[j] = a;
  }
  const Lanes scores = Reduce16(acc);
  std::memcpy(out, &scores, sizeof scores);
#endif
}

#ifdef __AVX512F__
// x[n][k] -> x[k][n] for 16 vectors of 16 32-bit lanes: pairs, then quads within each
// 128-bit lane, then a 4 x 4 transpose of the lanes.
inline void Transpose16x16(__m512i* x) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], lane L: rows 4i..4i+3 of column 4L + j
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), a1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44),
                  b1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    x[j] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    x[4 + j] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
    x[8 + j] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    x[12 + j] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
  }
}
#endif

#if defined(__AVX__) && !defined(__AVX512F__)
// x[n][k] -> x[k][n] for 8 vectors of 8 floats: pairs, then quads within each 128-bit
// half, then the halves.
inline void Transpose8x8(__m256* x) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    x[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}
#endif

// keys[d] = dimension d of 16 keys, from group ([16 keys][dims] float32; dims a multiple
// of 16): GroupScoresTransposed's operand.
inline void TransposeKeys(const float* group, int64_t dims, Lanes* keys) {
  float* out = reinterpret_cast<float*>(keys);
#if defined(__AVX512F__)
  for (int64_t c = 0; c < dims; c += kLanes) {
    __m512i x[kLanes];
    for (int j = 0; j < kLanes; ++j) x[j] = _mm512_loadu_si512(group + j * dims + c);
    Transpose16x16(x);
    for (int k = 0; k < kLanes; ++k) _mm512_storeu_si512(out + (c + k) * kLanes, x[k]);
  }
#elif defined(__AVX__)
  for (int64_t c = 0; c < dims; c += 8) {
    for (int h = 0; h < 2; ++h) {  // keys 8h .. 8h + 7
      __m256 x[8];
      for (int j = 0; j < 8; ++j) x[j] = _mm256_loadu_ps(group + (8 * h + j) * dims + c);
      Transpose8x8(x);
      for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + (c + k) * kLanes + 8 * h, x[k]);
    }
  }
#else
  for (int64_t d = 0; d < dims; ++d)
    for (int j = 0; j < kLanes; ++j) out[d * kLanes + j] = group[j * dims + d];
#endif
}

// GroupScores for N rows at once against the group's keys transposed (keys[d]: dimension
// d of the 16 keys, a lane each), with the very same arithmetic: lane l's partial sum of
// GroupScores is here a whole vector (every key's), q[l] * keys[l] + q[l + 16] * ..., and
// Reduce16's butterfly becomes adds of those vectors in its order (l + 8, then + 4, + 2,
// + 1), so the scores are bitwise GroupScores' (the same products fused into the same
// adds: test_cpu_kernel_token_is_bitwise_independent_of_its_batch compares a decode, scored
// by GroupScores, with the same token in a prefill chunk, scored here). No shuffles, and
// each key vector read serves N rows: 14 ns per row and group of keys against GroupScores'
// 19 (head_dim 64, operands in L1, 2-core AMX Xeon); a 500-token SmolLM2 prefill's
// attention without AMX 49.5-51.5 ms against 53.5-54.6 (scripts/bench_attention.py, 3
// interleaved rounds). A decode's few rows keep GroupScores: a transpose (~65 ns for 16
// keys of 64 float32 values) would cost more than it saves them. V: 16 lanes, or 8 (one
// of the two halves GroupScores' AVX2 code sums; keys then points at that half).
template <typename V, int C, int N>
JAXSERVE_FMA inline void GroupScoresTransposed(const float* const* q, const float* keys, int64_t chunks, float* out,
                                               int64_t stride) {
  const int64_t n = C > 0 ? C : chunks;
  auto load = [](const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  // Lane l's partial sums of the N rows (GroupScores' a for lane l).
  auto partial = [&](int l, V* x) {
    const V k0 = load(keys + l * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) x[r] = q[r][l] * k0;
#pragma GCC unroll 8
    for (int64_t c = 1; c < n; ++c) {
      const V k = load(keys + (c * kLanes + l) * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) x[r] = q[r][c * kLanes + l] * k + x[r];
    }
  };
  // Fully unrolled, so that the arrays below live in registers (~5 per row at a time).
  V u[2][N];
#pragma GCC unroll 2
  for (int a = 0; a < 2; ++a) {  // u_a = z_a + z_(a+2)
    V z[2][N];
#pragma GCC unroll 2
    for (int b = 0; b < 2; ++b) {  // z_l = y_l + y_(l+4), l = a + 2b
      V y[2][N];
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {  // y_l = x_l + x_(l+8), l = a + 2b + 4e
        V x0[N], x1[N];
        partial(a + 2 * b + 4 * e, x0);
        partial(a + 2 * b + 4 * e + 8, x1);
#pragma GCC unroll 8
        for (int r = 0; r < N; ++r) y[e][r] = x0[r] + x1[r];
      }
#pragma GCC unroll 8
      for (int r = 0; r < N; ++r) z[b][r] = y[0][r] + y[1][r];
    }
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) u[a][r] = z[0][r] + z[1][r];
  }
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) {
    const V score = u[0][r] + u[1][r];
    std::memcpy(out + r * stride, &score, sizeof score);
  }
}

// acc[r] += sum over the group's 16 keys j, in ascending order, of p[r][j] * V[j], for R
// rows. A probability of 0 (outside the row's positions) adds an exact zero.
//
// With AVX-512 the R x C accumulators (R * C registers of 16 lanes) stay in registers for
// the whole group. A 16-lane vector is two AVX2 registers, and AVX2 has 16: R x C = 16
// accumulators would be 32 and spill on every product (a third of a decode step's
// attention time on a Zen 2). Without AVX-512 the group is therefore taken in 8-lane
// halves of head_dim, a few at a time (8 accumulators in all, see below). Each output
// lane still sums its 16 products in ascending key order, so the result is the same.
struct NoPump {
  void operator()() const {}
};

// `pump` is called a few times along the way (TileRunner's deferred prefetches); it
// changes no arithmetic.
template <int C, int R, typename Pump = NoPump>
JAXSERVE_FMA inline void GroupValues(Lanes* acc, const float* const* p, const Lanes* values, int64_t chunks,
                                     Pump&& pump = Pump{}) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // In intrinsics, and H halves at a time so that H x R = 8 accumulators are in flight:
  // with R = 4 alone each waited on its own last multiply-add (4 cycles on a Zen 3: half
  // the two FMA units idle), and GCC's vectors stored them through the stack 16 bytes at a
  // time. The same products in the same order per output lane.
  if constexpr (C > 0) {
    constexpr int H = R >= 8 ? 1 : 8 / R;
    static_assert((2 * C) % H == 0, "head_dim's halves come in blocks of H");
    float* accf = reinterpret_cast<float*>(acc);
    const float* vf = reinterpret_cast<const float*>(values);
    for (int h0 = 0; h0 < 2 * C; h0 += H) {
      __m256 a[R][H];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) a[r][h] = _mm256_loadu_ps(accf + r * C * kLanes + (h0 + h) * 8);
      for (int j = 0; j < kLanes; ++j) {
        __m256 v[H];
        for (int h = 0; h < H; ++h) v[h] = _mm256_loadu_ps(vf + j * C * kLanes + (h0 + h) * 8);
        for (int r = 0; r < R; ++r) {
          const __m256 pj = _mm256_broadcast_ss(p[r] + j);
          for (int h = 0; h < H; ++h) a[r][h] = _mm256_fmadd_ps(pj, v[h], a[r][h]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) _mm256_storeu_ps(accf + r * C * kLanes + (h0 + h) * 8, a[r][h]);
      pump();
    }
    return;
  }
#elif !defined(__AVX512F__)
  if constexpr (C > 0) {
    float* accf = reinterpret_cast<float*>(acc);
    const float* vf = reinterpret_cast<const float*>(values);
    for (int h = 0; h < 2 * C; ++h) {  // each 8-lane half of head_dim
      Lanes8 a[R];
      for (int r = 0; r < R; ++r) a[r] = Half(accf + r * C * kLanes + h * 8);
      for (int j = 0; j < kLanes; ++j) {
        const Lanes8 v = Half(vf + j * C * kLanes + h * 8);
        for (int r = 0; r < R; ++r) a[r] = p[r][j] * v + a[r];
      }
      for (int r = 0; r < R; ++r) std::memcpy(accf + r * C * kLanes + h * 8, &a[r], sizeof a[r]);
      pump();
    }
    return;
  }
#endif
  if constexpr (C > 0) {
    Lanes a[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = acc[r * C + c];
    for (int j = 0; j < kLanes; ++j) {
      for (int c = 0; c < C; ++c) {
        // Chunk c of key j's value, in a register for the R rows' multiply-adds: left to
        // itself, GCC folds the load into each of them (R loads of the same 64 bytes), and a
        // Zen 4 core loads one such vector a cycle, as many as it multiply-adds: the loads
        // set the pace. The empty asm makes the value opaque, so it is loaded once. A
        // 500-token SmolLM2 prefill's attention (30 layers, bfloat16 cache, 2-core Zen 4)
        // 61.3-62.4 -> 54.6-55.0 ms, float32 cache 62.7-64.1 -> 58.6-59.6 ms
        // (scripts/bench_attention.py, alternating); the same products in the same order.
        Lanes v = values[j * C + c];
#if defined(__AVX512F__)
        asm("" : "+v"(v));
#endif
        for (int r = 0; r < R; ++r) a[r][c] = p[r][j] * v + a[r][c];
      }
      if (j % 4 == 3) pump();
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r * C + c] = a[r][c];
  } else {  // any head_dim: accumulators stay in memory
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kLanes; ++j)
        for (int64_t c = 0; c < chunks; ++c) acc[r * chunks + c] = p[r][j] * values[j * chunks + c] + acc[r * chunks + c];
  }
}

#ifdef __AVX512F__
// GroupValues' AVX-512 loop for a bfloat16 cache, its 16 value rows read where they lie
// (rows[j]: key j's head_dim values; a row of zeros where the key is not the tile's) and
// widened in registers: the same products in the same order, so the same bits. For a
// tile of one block of rows (a decode's), whose values each serve it once: widening them
// into a float32 buffer first stored and loaded every value once more.
template <int C, int R, typename Pump>
JAXSERVE_FMA inline void GroupValuesFromRows(Lanes* acc, const float* const* p, const uint16_t* const* rows, Pump&& pump) {
  Lanes a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = acc[r * C + c];
  for (int j = 0; j < kLanes; ++j) {
    for (int c = 0; c < C; ++c) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + c * kLanes)));
      Lanes v;
      const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));  // exact, as LoadLanes
      std::memcpy(&v, &wide, sizeof v);
      asm("" : "+v"(v));  // once in a register for the R rows (GroupValues says why)
      for (int r = 0; r < R; ++r) a[r][c] = p[r][j] * v + a[r][c];
    }
    if (j % 4 == 3) pump();
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r * C + c] = a[r][c];
}
#endif

}  // namespace

#endif  // JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_ROW_MATH_H_
