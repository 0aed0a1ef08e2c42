// Ragged paged attention on the CPU: an XLA FFI custom call (see cpu.py).
//
// Same contract as reference.py: a flat ragged batch of prefill chunks and decodes,
// causal (optionally sliding-window) attention of each query token over its own
// sequence's pages, in the shared head-major layout
//
//     kv_cache[2 * Hkv, L, num_pages, page_size, D]   (float32, or bfloat16 bits as uint16,
//                                                       or int8 / float8_e4m3fn with
//     scales[2 * Hkv, L, num_pages, page_size]         a float32 scale per token and head)
//
// Work is split into tiles of one sequence, one KV head and up to kRows query rows
// (row = query token x query head sharing the KV head). For each tile, keys are taken in
// groups of 16 positions (groups start at multiples of 16), each widened to float32 once
// into a small buffer that every row of the tile reads:
//   1. scores: per row, 16 keys' 16-lane partial dot products, summed by a fixed
//      butterfly (Reduce16); a tile of many rows takes the keys transposed instead, which
//      turns the butterfly into adds of whole vectors, bitwise the same scores
//      (GroupScoresTransposed);
//   2. softmax per row over its own positions [lo, pos], exactly (two passes, no online
//      rescaling);
//   3. output: p * V accumulated in ascending position order, a few rows at a time with
//      their accumulators in registers.
// Each row's arithmetic (the order of every sum) depends only on the row itself, never
// on the tile or the batch around it, so a token's output is bit-identical however it
// was batched, whether as a decode or inside a prefill chunk.
//
// Without AVX-512 the hot loops work on 8-lane halves of the same vectors (GCC's code for
// 16-lane vectors on AVX2 spills them), with bitwise the same arithmetic.
//
// A bfloat16 cache on a CPU with AMX (cpu_amx.h) runs the same tiles on the tile unit
// instead (AmxTileRunner): the two products as bfloat16 tile products, the float32
// operands split into bfloat16 hi + lo pairs, the same softmax. Every row of such a cache
// is computed that way, so the invariance above holds there too.
//
// Built on first use by cpu.py with the machine's C++ compiler (-O3 -march=native).

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/cpu_bf16.h"
#include "pallas_kernels/cpu_exp.h"
#include "pallas_kernels/cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // partial sums of a dot product
constexpr int kRows = 64;   // query rows per tile (at most)
// For functions whose only effect is prefetching: GCC deems such a function pure (a
// prefetch changes nothing it can see) and deletes the calls it has not inlined yet, which
// left not one prefetch instruction in the library (a 32-sequence decode's attention
// then took 2.2x as long, its loads waiting on memory).
#define JAXSERVE_PREFETCHER __attribute__((always_inline)) inline

// 16 floats: one AVX-512 register, two AVX2 ones, four NEON ones (GCC/Clang vectors).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Bits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Bits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bits) { return jaxserve::Bf16ToFloat(bits); }

// An 8-bit cache's element types; their rows are read as values * the row's scale.
struct Fp8 {  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

// Every float8_e4m3fn value as float32 (exact), indexed by its bits.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float magnitude = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1 + m / 8.0f, e - 7);
      value[b] = b & 128 ? -magnitude : magnitude;
    }
  }
};
const Fp8Table kFp8;

inline float ToFloat(int8_t x) { return static_cast<float>(x); }
inline float ToFloat(Fp8 x) { return kFp8.value[x.bits]; }

// 16 consecutive values as float32 lanes.
inline Lanes LoadLanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Lanes LoadLanes(const uint16_t* p) {
  Bits16 b;
  std::memcpy(&b, p, sizeof b);
  Bits32 wide = __builtin_convertvector(b, Bits32) << 16;
  Lanes v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
// 8-bit values: with AVX-512 by its widening loads (GCC turns the generic vector
// conversions below into one scalar insert per lane).
inline Lanes LoadLanes(const int8_t* p) {
#ifdef __AVX512F__
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  Lanes out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}
// float8_e4m3fn's bits shifted into float16's exponent and mantissa fields are the same
// value times 2^-8, subnormals included (both formats scale them alike): widened by the
// CPU's half-precision conversion, then times 2^8 (exact). Never a NaN: the write clips.
inline Lanes LoadLanes(const Fp8* p) {
#ifdef __AVX512F__
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 8),
                                       _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7f)), 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)), _mm512_set1_ps(256.0f));
  Lanes out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = kFp8.value[p[i].bits];
  return v;
#endif
}

// Sum of 16 lanes, always by the same tree: halves added lane-wise, 16 -> 8 -> 4 -> 2 -> 1
// (SumLanes8 after the first level, which each softmax adds its own way).
typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));

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

struct Problem {
  // The queries: column h * D + d of token t holds head h's value d, in a [q_slices, T,
  // q_width] array (a linear layer's product by column slices, cpu_matmul.cc; a plain
  // [T, Hq, D] is one slice). With cos and sin ([T, D]) each row is rotated (rotate-half
  // RoPE) as it is read.
  const float* q;
  int64_t q_slices, q_width;
  const float *cos, *sin;  // null: the rows are rotated already
  const void* kv;          // [2*Hkv, L, P, PS, D]
  const float* scales;     // [2*Hkv, L, P, PS] for an 8-bit cache, else null
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_pages, page_size, num_layers;
  int32_t layer, window;
  const int32_t* kv_lens;  // [S]
  const int32_t* page_table;  // [S, W]
  int64_t pages_per_seq;
  const int32_t* query_start_loc;  // [S+1]
  float sm_scale;
  void* out;     // [T, Hq, D]: float32, or bfloat16 bits where out_bf16
  bool out_bf16;  // the next layer (a bfloat16 matmul) reads it so: no float32 copy between
};

struct Tile {
  int32_t seq, kv_head, first_token, num_tokens;  // tokens relative to the sequence's first
};

// The cache row (of head_dim values; a scale's index) of slot `slot` of page `page` in a
// K (plane < Hkv) or V plane of the problem's layer.
inline int64_t CacheRow(const Problem& pb, int64_t plane, int64_t page, int64_t slot) {
  return ((plane * pb.num_layers + pb.layer) * pb.num_pages + page) * pb.page_size + slot;
}

// Calls run(row, position, count) for positions [from, to) of sequence seq's K (plane <
// Hkv) or V plane, a page at a time: row is the cache row (of head_dim values; a scale's
// index) of `position`, and the page's next count - 1 rows follow it. Reading the page
// table (and dividing by the page size) once per page instead of once per position took
// ~15% off a 32-sequence decode's attention (2-core AMX Xeon).
template <typename Run>
JAXSERVE_PREFETCHER void PageRuns(const Problem& pb, int32_t seq, int64_t plane, int32_t from, int32_t to, Run&& run) {
  for (int32_t position = from; position < to;) {
    const int32_t in_page = static_cast<int32_t>(position % pb.page_size);
    const int32_t n = std::min<int32_t>(to - position, static_cast<int32_t>(pb.page_size) - in_page);
    const int64_t page = pb.page_table[seq * pb.pages_per_seq + position / pb.page_size];
    run(CacheRow(pb, plane, page, in_page), position, n);
    position += n;
  }
}

// The K or V rows (of head_dim T values) of positions [first, first + count) into rows,
// nullptr outside [jlo, jhi) (not the tile's: read as zeros, as unwritten slots may hold
// anything).
template <typename T>
void PlaneRows(const Problem& pb, int32_t seq, int64_t plane, int32_t first, int count, int32_t jlo, int32_t jhi,
               const T** rows) {
  for (int i = 0; i < count; ++i) rows[i] = nullptr;
  PageRuns(pb, seq, plane, std::max(first, jlo), std::min(first + count, jhi), [&](int64_t row, int32_t position, int32_t n) {
    for (int32_t i = 0; i < n; ++i) rows[position - first + i] = static_cast<const T*>(pb.kv) + (row + i) * pb.head_dim;
  });
}

// The D values of token `token` from column `col` of the product (Problem::q) where
// they lie whole in one slice and need no rotation, else in buf (2 * D floats). The
// rotation (`rotate` and cos given) is rotate_half_rope's (common.py), v * cos +
// rotate_half(v) * sin, always as fma(v, cos, rotate_half(v) * sin): how XLA:CPU's own
// fusion of it rounds standing alone (XLA decides per fusion; fused with the cache's cast
// it had not contracted every element). It spares the pass that gathered and rotated q
// from the product (~6 ms of a 500-token SmolLM2 prefill, 2-core AMX Xeon).
inline const float* ProductRow(const Problem& pb, int64_t token, int64_t col, bool rotate, float* buf) {
  const int64_t D = pb.head_dim, w = pb.q_width;
  const int64_t first = col / w, last = (col + D - 1) / w;
  const float* v = pb.q + (first * pb.num_tokens + token) * w + col - first * w;
  if (first != last) {  // across slices: gathered
    float* gathered = buf + D;
    for (int64_t i = first, c = col; i <= last; ++i) {
      const int64_t end = std::min(col + D, (i + 1) * w);
      std::memcpy(gathered + c - col, pb.q + (i * pb.num_tokens + token) * w + c - i * w, (end - c) * sizeof(float));
      c = end;
    }
    v = gathered;
  }
  if (!rotate || pb.cos == nullptr) return v;
  const float *cs = pb.cos + token * D, *sn = pb.sin + token * D;
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) buf[j] = std::fma(v[j], cs[j], -v[j + half] * sn[j]);
  for (int64_t j = half; j < D; ++j) buf[j] = std::fma(v[j], cs[j], v[j - half] * sn[j]);
  return buf;
}

// Token `token`'s query for head `head` (ProductRow).
inline const float* QueryRow(const Problem& pb, int64_t token, int64_t head, float* buf) {
  return ProductRow(pb, token, head * pb.head_dim, true, buf);
}

// A tile's rows: row r is token first_token + r / G with query head kv_head * G + r % G.
// Sets each row's position and lowest visible position (the sliding window) and hands
// its query to query(r, q).
template <typename Query>
void TileRows(const Problem& pb, const Tile& t, std::vector<int32_t>& pos, std::vector<int32_t>& lo, Query&& query) {
  const int64_t G = pb.num_heads / pb.num_kv_heads;
  const int32_t q_start = pb.query_start_loc[t.seq];
  const int32_t first_pos = pb.kv_lens[t.seq] - (pb.query_start_loc[t.seq + 1] - q_start);
  const int rows = t.num_tokens * static_cast<int>(G);
  pos.resize(rows);
  lo.resize(rows);
  thread_local std::vector<float> buf;
  buf.resize(2 * pb.head_dim);
  for (int r = 0; r < rows; ++r) {
    const int32_t i = t.first_token + r / G;
    pos[r] = first_pos + i;
    lo[r] = pb.window > 0 ? std::max(0, pos[r] - pb.window + 1) : 0;
    query(r, QueryRow(pb, q_start + i, t.kv_head * G + r % G, buf.data()));
  }
}

// Row r's output: acc[d] * inv for its D values, stored as the output's dtype.
inline void StoreRow(const Problem& pb, const Tile& t, int r, const float* acc, float inv) {
  const int64_t G = pb.num_heads / pb.num_kv_heads, D = pb.head_dim;
  const int32_t token = pb.query_start_loc[t.seq] + t.first_token + r / G;
  const int64_t at = (token * pb.num_heads + t.kv_head * G + r % G) * D;
  if (!pb.out_bf16) {
    float* o = static_cast<float*>(pb.out) + at;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(pb.out) + at;
  for (int64_t d = 0; d < D; ++d) o[d] = jaxserve::Bf16Bits(acc[d] * inv);
}

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
// those of the 16-lane code. Lanes8 is defined above.
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

// T: the cache's element type (an 8-bit one's rows are widened times their scales). C:
// head_dim / 16 when the dispatch knows it (1, 2, 4, 8),
// so a K or V row lives in registers; 0 for any other head_dim (zero-padded chunks).
//
// Keys are taken in groups of 16 positions starting at multiples of 16, widened to
// float32 (for a tile of many rows also transposed) once per tile into a small buffer;
// every row of the tile reads them there.
template <typename T, int C>
class TileRunner {
 public:
  explicit TileRunner(const Problem& pb) : pb_(pb) {}

  // Rows of a tile summed together in GroupValues (their accumulators fit in registers).
  static constexpr int kValueRows = C >= 8 ? 2 : C >= 4 ? 4 : 8;
  // Rows scored together by GroupScoresTransposed (~5 of its vectors per row stay in
  // registers: 32 of them with AVX-512, 16 of half the width without), and the fewest
  // rows of a tile for which transposing its keys pays (~5 ns saved per row against
  // 25-65 ns per group's transpose).
#ifdef __AVX512F__
  static constexpr int kScoreRows = 4;
#else
  static constexpr int kScoreRows = 2;
#endif
  static constexpr int kTransposeRows = 12;

  void Run(const Tile& t) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim, G = pb.num_heads / pb.num_kv_heads;
    const int64_t chunks = C > 0 ? C : (D + kLanes - 1) / kLanes;  // head_dim in 16-lane chunks
    const int rows = t.num_tokens * static_cast<int>(G);

    // Rows: position, lowest visible position, scaled query.
    qs_.assign(static_cast<size_t>(rows) * chunks, Lanes{});
    TileRows(pb, t, pos_, lo_, [&](int r, const float* q) {
      float* qs = reinterpret_cast<float*>(&qs_[r * chunks]);
      for (int64_t d = 0; d < D; ++d) qs[d] = q[d] * pb.sm_scale;
    });
    const int32_t jlo = lo_[0];              // the tile's lowest visible position
    const int32_t jhi = pos_[rows - 1] + 1;  // one past its highest
    const int32_t base = jlo - jlo % kLanes;  // the first group's first position
    const int32_t groups = (jhi - base + kLanes - 1) / kLanes;
    const int64_t width = static_cast<int64_t>(groups) * kLanes;  // scores per row, from base
    scores_.resize(static_cast<size_t>(rows) * width);
    group_.resize(static_cast<size_t>(kLanes) * chunks);
    keys_.resize(static_cast<size_t>(kLanes) * chunks);

    // Fetch ahead: the pages are scattered, and misses in flight beat one demand miss
    // after another. The first groups of K and V now; each LoadGroup then asks for the
    // group kAhead further on.
    for (int32_t g = 0; g < std::min(groups, kAhead); ++g) {
      Prefetch(t.seq, t.kv_head, base + g * kLanes, jlo, jhi);
      Prefetch(t.seq, pb.num_kv_heads + t.kv_head, base + g * kLanes, jlo, jhi);
    }

    // 1. Scores, a group of 16 keys at a time (a row's scores outside [lo, pos] are not
    // read): per row, or with the keys transposed kScoreRows rows at a time, every block
    // of rows of which one sees the group.
    // (Not for head_dim <= 16: there the products would meet the butterfly's first adds
    // directly, and GCC would fuse them into multiply-adds, GroupScores' scores no more.)
    const bool transposed = rows >= kTransposeRows && chunks > 1;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t first = base + g * kLanes;
      if (!transposed) {
        LoadGroup(t.seq, t.kv_head, first, jlo, jhi, /*defer=*/true);
        const int64_t share = (pending_lines_ + rows - 1) / rows;
        for (int r = 0; r < rows; ++r) {
          if (first <= pos_[r] && first + kLanes > lo_[r]) {
            GroupScores<C>(&qs_[r * chunks], group_.data(), chunks, &scores_[r * width + g * kLanes]);
          }
          Pump(share);
        }
        continue;
      }
      LoadKeys(t.seq, t.kv_head, first, jlo, jhi);
      for (int r0 = 0; r0 < rows; r0 += kScoreRows) {
        const int n = std::min(kScoreRows, rows - r0);
        bool any = false;
        for (int r = r0; r < r0 + n; ++r) any |= first <= pos_[r] && first + kLanes > lo_[r];
        if (any) ScoreRows(r0, n, &scores_[r0 * width + g * kLanes], width);
      }
    }

    // 2. Softmax per row over its own positions [lo, pos] (zeros outside them).
    denom_.resize(rows);
    for (int r = 0; r < rows; ++r) {
      float* s = &scores_[r * width];
#ifdef __AVX512F__
      denom_[r] = SoftmaxRow(s, base, lo_[r], pos_[r], [s](int32_t g, Lanes p) { std::memcpy(s + g * kLanes, &p, sizeof p); });
#else
      denom_[r] = SoftmaxRowHalves(s, base, lo_[r], pos_[r]);
#endif
    }

    // 3. Output: sum of p * V in ascending position order, per row, kValueRows rows at once
    // (the last block's spare rows have empty key ranges: they add nothing).
    const int padded_rows = (rows + kValueRows - 1) / kValueRows * kValueRows;
    const int64_t blocks = padded_rows / kValueRows;
    acc_.assign(static_cast<size_t>(padded_rows) * chunks, Lanes{});
    static const float kZeros[kLanes] = {};
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t first = base + g * kLanes;
      LoadGroup(t.seq, pb.num_kv_heads + t.kv_head, first, jlo, jhi, /*defer=*/!transposed);
      const int64_t share = (pending_lines_ + 4 * blocks - 1) / (4 * blocks);
      for (int r0 = 0; r0 < rows; r0 += kValueRows) {
        const float* p[kValueRows];  // each row's 16 probabilities (zeros: none in this group)
        bool any = false;
        for (int k = 0; k < kValueRows; ++k) {
          const int r = r0 + k;
          const bool sees = r < rows && first <= pos_[r] && first + kLanes > lo_[r];
          p[k] = sees ? &scores_[r * width + g * kLanes] : kZeros;
          any |= sees;
        }
        if (any) {
          GroupValues<C, kValueRows>(&acc_[r0 * chunks], p, group_.data(), chunks, [&] { Pump(share); });
        } else {
          Pump(4 * share);
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      StoreRow(pb, t, r, reinterpret_cast<const float*>(&acc_[r * chunks]), 1.0f / denom_[r]);
    }
  }

 private:
  static constexpr int kAhead = 4;  // groups fetched ahead of the one being read

  // Into the second-level cache (locality 2: PREFETCHT1), not the first: the first level
  // tracks few misses at once (a group ahead is 32-64 lines), so each prefetch beyond them
  // stalled until one came in, and a decode read the cache at ~9 GB/s of the 45 two cores
  // stream. From the second level the group's loads wait ~a dozen cycles, not on memory.
  // A 32-sequence decode's attention (30 layers, 264 positions; Zen 4, 2 cores) 20-23 ->
  // 14-16 ms with a bfloat16 cache, 36 -> 24-28 ms with float32; prefills the same.
  // The group at `first` all at once (Defer, then every pending line).
  JAXSERVE_PREFETCHER void Prefetch(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
    Defer(seq, plane, first, jlo, jhi);
    Pump(pending_lines_);
  }

  // A tile of few rows (a decode's) holds each group's prefetch back (Defer) and issues it a
  // share at a time between its rows' scores and inside its p * V (Pump): the group's 32-64
  // lines asked for at once stalled the core on the prefetch instructions themselves once
  // the miss queue was full (perf put ~22% of the runner's own time on them), so memory
  // and arithmetic took turns: a 32-sequence decode's attention (30 layers, 232 positions)
  // took 12.2 ms with every sequence's pages in memory against 8.8 ms with all of them
  // reading the same cached pages. Spread out: float32 cache 20.9-24.5 -> 16.1-17.7 ms,
  // bfloat16 11.5-13.0 -> 10.7-11.8 ms (Zen 4, 2 cores, 4 alternating rounds of
  // scripts/bench_attention.py); offline 32 x 200 / 64 +3.5% / +10.8% bfloat16, +5.7% /
  // +9.5% float32 (alternating pairs, the same outputs). Prefill tiles keep whole-group
  // prefetches: their arithmetic per group dwarfs the stall.
  JAXSERVE_PREFETCHER void Defer(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
    Pump(pending_lines_);
    const int64_t row_bytes = pb_.head_dim * static_cast<int64_t>(sizeof(T));
    PageRuns(pb_, seq, plane, std::max(first, jlo), std::min(first + kLanes, jhi), [&](int64_t row, int32_t, int32_t n) {
      const char* bytes = reinterpret_cast<const char*>(static_cast<const T*>(pb_.kv) + row * pb_.head_dim);
      if (num_pending_ == kMaxPending) Pump(pending_lines_);  // more runs than slots (pages of < 4 tokens)
      const int64_t lines = (n * row_bytes + 63) / 64;
      pending_[num_pending_++] = {bytes, lines};
      pending_lines_ += lines;
    });
  }
  JAXSERVE_PREFETCHER void Pump(int64_t lines) {
    while (lines > 0 && num_pending_ > 0) {
      Pending& run = pending_[num_pending_ - 1];
      const int64_t n = std::min(lines, run.lines);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(run.next + 64 * i, 0, 2);
      run.next += 64 * n;
      run.lines -= n;
      lines -= n;
      pending_lines_ -= n;
      if (run.lines == 0) --num_pending_;
    }
  }
  struct Pending {
    const char* next;
    int64_t lines;
  };
  static constexpr int kMaxPending = 4;
  Pending pending_[kMaxPending];
  int num_pending_ = 0;
  int64_t pending_lines_ = 0;

  // GroupScoresTransposed of rows [r0, r0 + n) (n <= kScoreRows) against keys_ into out.
  void ScoreRows(int r0, int n, float* out, int64_t width) const {
    const int64_t chunks = C > 0 ? C : (pb_.head_dim + kLanes - 1) / kLanes;
    const float* q[kScoreRows];
    for (int r = 0; r < n; ++r) q[r] = reinterpret_cast<const float*>(&qs_[(r0 + r) * chunks]);
    const float* keys = reinterpret_cast<const float*>(keys_.data());
#ifdef __AVX512F__
    switch (n) {
      case 1: return GroupScoresTransposed<Lanes, C, 1>(q, keys, chunks, out, width);
      case 2: return GroupScoresTransposed<Lanes, C, 2>(q, keys, chunks, out, width);
      case 3: return GroupScoresTransposed<Lanes, C, 3>(q, keys, chunks, out, width);
      default: return GroupScoresTransposed<Lanes, C, kScoreRows>(q, keys, chunks, out, width);
    }
#else
    for (int h = 0; h < 2; ++h) {  // GroupScores' halves: keys 0-7, then 8-15
      if (n == 1) {
        GroupScoresTransposed<Lanes8, C, 1>(q, keys + 8 * h, chunks, out + 8 * h, width);
      } else {
        GroupScoresTransposed<Lanes8, C, kScoreRows>(q, keys + 8 * h, chunks, out + 8 * h, width);
      }
    }
#endif
  }

  // The K rows of positions [first, first + 16) into keys_, transposed: keys_[d] holds
  // dimension d of the 16 keys as float32, zero for rows outside [jlo, jhi) and past
  // head_dim. A bfloat16 cache with AVX-512 goes straight from its rows: a 16 x 16
  // transpose of 32-bit pairs of dimensions, each pair's halves then widened (exactly as
  // ToFloat widens them), instead of widening 16 x head_dim values and transposing those.
  void LoadKeys(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, uint16_t> && C > 0 && C % 2 == 0) {
      Prefetch(seq, plane, first + kAhead * kLanes, jlo, jhi);
      const uint16_t* rows[kLanes];
      PlaneRows(pb_, seq, plane, first, kLanes, jlo, jhi, rows);
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      float* out = reinterpret_cast<float*>(keys_.data());
      for (int c = 0; c < C / 2; ++c) {  // 32 dimensions: 16 pairs
        __m512i x[kLanes];
        for (int j = 0; j < kLanes; ++j) x[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * c) : _mm512_setzero_si512();
        Transpose16x16(x);  // x[p]: dimensions 2p (low half) and 2p + 1 of every key
        for (int p = 0; p < kLanes; ++p) {
          _mm512_storeu_si512(out + (32 * c + 2 * p) * kLanes, _mm512_slli_epi32(x[p], 16));
          _mm512_storeu_si512(out + (32 * c + 2 * p + 1) * kLanes, _mm512_and_si512(x[p], high));
        }
      }
      return;
    }
#endif
    LoadGroup(seq, plane, first, jlo, jhi);
    const int64_t chunks = C > 0 ? C : (pb_.head_dim + kLanes - 1) / kLanes;
    TransposeKeys(reinterpret_cast<const float*>(group_.data()), chunks * kLanes, keys_.data());
  }

  // K or V rows of positions [first, first + 16) as float32 chunks into group_; rows
  // outside [jlo, jhi) (not this tile's to read) and lanes past head_dim are zero.
  void LoadGroup(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi, bool defer = false) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim;
    Defer(seq, plane, first + kAhead * kLanes, jlo, jhi);
    if (!defer) Pump(pending_lines_);
    const int64_t chunks = C > 0 ? C : (D + kLanes - 1) / kLanes;
    int64_t rows[kLanes];  // cache rows; -1 outside [jlo, jhi)
    for (int j = 0; j < kLanes; ++j) rows[j] = -1;
    PageRuns(pb, seq, plane, std::max(first, jlo), std::min(first + kLanes, jhi), [&](int64_t row, int32_t position, int32_t n) {
      for (int32_t i = 0; i < n; ++i) rows[position - first + i] = row + i;
    });
    for (int j = 0; j < kLanes; ++j) {
      Lanes* dst = &group_[j * chunks];
      if (rows[j] < 0) {
        for (int64_t c = 0; c < chunks; ++c) dst[c] = Lanes{};
        continue;
      }
      const T* x = static_cast<const T*>(pb.kv) + rows[j] * D;
      if constexpr (C > 0 && std::is_same_v<T, float>) {
        // A copy (on AVX2 GCC's 16-lane loads and stores went through the stack 16 bytes
        // at a time: a 32-sequence decode's attention 34-39 -> 32-36 ms on a Zen 3).
        std::memcpy(dst, x, C * sizeof(Lanes));
#if defined(__AVX2__) && !defined(__AVX512F__)
      } else if constexpr (C > 0 && std::is_same_v<T, uint16_t>) {
        // LoadLanes' widening, 8 at a time: 64 decodes at 300 positions over a bfloat16
        // cache, 30 layers, 73-78 -> 61-68 ms on a Zen 3 (scripts/bench_attention.py).
        for (int h = 0; h < 2 * C; ++h) {
          const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * h));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + h, _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
        }
#endif
      } else if constexpr (C > 0) {
        for (int c = 0; c < C; ++c) dst[c] = LoadLanes(x + c * kLanes);
      } else {
        float* f = reinterpret_cast<float*>(dst);
        for (int64_t d = 0; d < chunks * kLanes; ++d) f[d] = d < D ? ToFloat(x[d]) : 0.0f;
      }
      if constexpr (kScaled<T>) {
        const float scale = pb.scales[rows[j]];
        for (int64_t c = 0; c < chunks; ++c) dst[c] *= scale;
      }
    }
  }

  const Problem& pb_;
  std::vector<int32_t> pos_, lo_;
  std::vector<Lanes> qs_, group_, keys_, acc_;  // [rows, chunks], [16, chunks], [chunks * 16], [rows, chunks]
  std::vector<float> scores_, denom_;
};

#ifdef JAXSERVE_HAVE_AMX
// The same tiles on AMX, for a bfloat16 cache and a head_dim that is a multiple of 32: the
// two products run as bfloat16 tile products with float32 accumulation, the softmax as in
// TileRunner. The float32 operands (the scaled query, the probabilities) go in as
// bfloat16 hi + lo pairs (SplitBf16), so the result stays within ~1e-5 of float32
// arithmetic on the same bfloat16 K and V (the tests hold it to 2e-5). A 500-token
// prefill in one SmolLM2 layer: ~1.0 ms against the vector path's ~1.8 (2-core Xeon).
//
// Rows stay independent: a tile product's element depends only on its own row of the
// left operand, its column of the right one and its accumulator, so a row's scores and
// output are the same in any tile, padded to 16 rows or not. Blocks of positions start at
// multiples of 16 (scores) and 32 (p * V) from position 0, positions a row does not see
// have probability 0 and add an exact zero, and every row is computed this way (decodes
// too), so a token's output is bit-identical however it was batched.
class AmxTileRunner {
 public:
  explicit AmxTileRunner(const Problem& pb) : pb_(pb) {}

  void Run(const Tile& t) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim, G = pb.num_heads / pb.num_kv_heads;
    const int rows = t.num_tokens * static_cast<int>(G);
    const int padded = (rows + 15) / 16 * 16;

    // Rows: position, lowest visible position, scaled query as hi + lo. Padding rows (to
    // 16) are left as they are: a tile product's row depends only on its own row of the
    // left operand, so they reach only padding rows of the results.
    q_hi_.resize(static_cast<size_t>(padded) * D);
    q_lo_.resize(static_cast<size_t>(padded) * D);
    const __m512 scale = _mm512_set1_ps(pb.sm_scale);
    TileRows(pb, t, pos_, lo_, [&](int r, const float* q) {
      for (int64_t d = 0; d < D; d += 16) {
        jaxserve::SplitBf16(_mm512_mul_ps(_mm512_loadu_ps(q + d), scale), &q_hi_[r * D + d], &q_lo_[r * D + d]);
      }
    });
    const int32_t jlo = lo_[0], jhi = pos_[rows - 1] + 1;  // the positions the tile reads
    const int32_t base = jlo - jlo % 32;
    const int32_t blocks = (jhi - base + 31) / 32;  // of 32 positions: two score groups each
    const int64_t width = static_cast<int64_t>(blocks) * 32;

    // A block of 16 rows reads the positions from its first row's lo to its last row's pos.
    auto row_range = [&](int r0) {
      const int last = std::min(r0 + 15, rows - 1);
      return std::pair<int32_t, int32_t>{lo_[r0] - base, pos_[last] - base};
    };

    // 1. Scores: per 16 rows and 16 positions, sum over head_dim in 32s of q_hi.K + q_lo.K.
    // The values' rows are fetched meanwhile, for step 3.
    const int64_t chunks = D / 32;
    const int64_t v_plane = pb.num_kv_heads + t.kv_head;
    scores_.resize(static_cast<size_t>(padded) * width);
    if (rows <= 16 && chunks <= 2 && pb.page_size % 16 == 0) {
      // One block of rows (a decode): the scores transposed, K . q^T, with K's tiles read
      // straight from its pages (a group of 16 positions is 16 rows of one page) and q^T
      // made once, instead of transposing every group of keys. A product's element is the
      // same either way round (the same bfloat16 pairs in the same order; the tests check
      // a decode against the same token in a prefill chunk). A group's keys outside
      // [jlo, jhi) only reach that position's scores, which the softmax masks.
      const auto [from, to] = row_range(0);
      for (int64_t c = 0; c < chunks; ++c) {
        for (int part = 0; part < 2; ++part) {
          const uint16_t* q = (part ? q_lo_ : q_hi_).data() + c * 32;
          __m512i x[16];
          for (int n = 0; n < 16; ++n) x[n] = _mm512_loadu_si512(q + n * D);
          Transpose16x16(x);
          for (int k = 0; k < 16; ++k) _mm512_storeu_si512(&q_t_[((c * 2 + part) * 16 + k) * 32], x[k]);
        }
      }
      _tile_loadd(2, &q_t_[0], 64);
      _tile_loadd(3, &q_t_[512], 64);
      if (chunks == 2) {
        _tile_loadd(4, &q_t_[1024], 64);
        _tile_loadd(5, &q_t_[1536], 64);
      }
      // Two groups at a time, each in its own accumulator (tiles 0 and 1), so that a
      // product need not wait for the sum before it (one group's four chained products
      // took ~30% of a decode's attention); each still adds hi then lo, chunk by chunk.
      const int32_t g_first = from / 16, g_last = to / 16;
      for (int32_t g = g_first; g < std::min(g_last + 1, g_first + kAhead); ++g) {
        Prefetch(t.seq, t.kv_head, base + g * 16, jlo, jhi);
      }
      alignas(64) float transposed[2][256];
      for (int32_t g = g_first; g <= g_last; g += 2) {
        const int n = std::min(2, g_last - g + 1);  // groups in this round
        for (int i = 0; i < n; ++i) {
          Prefetch(t.seq, t.kv_head, base + (g + i + kAhead) * 16, jlo, jhi);
          Prefetch<1>(t.seq, v_plane, base + (g + i) * 16, jlo, jhi);
        }
        const uint16_t* k0 = PageRow(t.seq, t.kv_head, base + g * 16);
        const uint16_t* k1 = n == 2 ? PageRow(t.seq, t.kv_head, base + (g + 1) * 16) : nullptr;
        _tile_zero(0);
        if (n == 2) _tile_zero(1);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(6, k0 + c * 32, D * 2);
          if (n == 2) _tile_loadd(7, k1 + c * 32, D * 2);
          if (c == 0) {
            _tile_dpbf16ps(0, 6, 2);
            if (n == 2) _tile_dpbf16ps(1, 7, 2);
            _tile_dpbf16ps(0, 6, 3);
            if (n == 2) _tile_dpbf16ps(1, 7, 3);
          } else {
            _tile_dpbf16ps(0, 6, 4);
            if (n == 2) _tile_dpbf16ps(1, 7, 4);
            _tile_dpbf16ps(0, 6, 5);
            if (n == 2) _tile_dpbf16ps(1, 7, 5);
          }
        }
        _tile_stored(0, transposed[0], 64);
        if (n == 2) _tile_stored(1, transposed[1], 64);
        for (int i = 0; i < n; ++i) {
          __m512i x[16];
          for (int j = 0; j < 16; ++j) x[j] = _mm512_load_si512(transposed[i] + j * 16);
          Transpose16x16(x);
          for (int r = 0; r < rows; ++r) _mm512_storeu_si512(&scores_[r * width + (g + i) * 16], x[r]);
        }
      }
    } else {
      LoadKeys(t, base, blocks, jlo, jhi, [&](int32_t g) { Prefetch<1>(t.seq, v_plane, base + g * 16, jlo, jhi); });
      for (int r0 = 0; r0 < rows; r0 += 16) {
        const auto [from, to] = row_range(r0);
        for (int32_t g = from / 16; g <= to / 16; g += 4) {
          switch (std::min<int32_t>(4, to / 16 - g + 1)) {
            case 1: ScoreGroups<1>(r0, g, width); break;
            case 2: ScoreGroups<2>(r0, g, width); break;
            case 3: ScoreGroups<3>(r0, g, width); break;
            default: ScoreGroups<4>(r0, g, width);
          }
        }
      }
    }

    // 2. Softmax per row, its probabilities stored as hi + lo, and zeros in the rest of
    // its 16-row block's range.
    denom_.resize(rows);
    p_hi_.resize(static_cast<size_t>(padded) * width);
    p_lo_.resize(static_cast<size_t>(padded) * width);
    for (int r = 0; r < rows; ++r) {
      const auto [from, to] = row_range(r / 16 * 16);
      uint16_t *hi = &p_hi_[r * width], *lo = &p_lo_[r * width];
      denom_[r] = SoftmaxRow(&scores_[r * width], base, lo_[r], pos_[r], [hi, lo](int32_t g, Lanes p) {
        __m512 x;
        std::memcpy(&x, &p, sizeof x);
        jaxserve::SplitBf16(x, hi + g * 16, lo + g * 16);
      });
      const int32_t g_lo = (lo_[r] - base) / 16, g_hi = (pos_[r] - base) / 16;
      auto zero = [hi, lo](int32_t g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + g * 16), _mm256_setzero_si256());
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + g * 16), _mm256_setzero_si256());
      };
      for (int32_t g = from / 32 * 2; g < g_lo; ++g) zero(g);  // whole blocks of 32 positions
      for (int32_t g = g_hi + 1; g <= to / 32 * 2 + 1; ++g) zero(g);
    }

    // 3. Output: per 16 rows and 16 of head_dim, sum over blocks of 32 positions, in
    // ascending order, of p_hi.V + p_lo.V; four accumulators (64 of head_dim) at a time.
    // A tile of one block of rows (a decode) packs each block's values just before its
    // products, into a buffer that stays in the first-level cache; packed all at once
    // (~36 KB at head_dim 64), they had left for the second level before the products
    // read them: the packing's stores drew ~27% of the kernel's samples in a 32-sequence
    // decode whose pages were all in cache.
    const bool block_by_block = padded == 16;
    if (!block_by_block) LoadValues(t, base, blocks, jlo, jhi);
    acc_.resize(static_cast<size_t>(padded) * D);
    const int64_t columns = D / 16;
    for (int r0 = 0; r0 < rows; r0 += 16) {
      const auto [from, to] = row_range(r0);
      for (int64_t c0 = 0; c0 < columns; c0 += 4) {
        const int64_t n = std::min<int64_t>(4, columns - c0);  // 2 or 4 (head_dim % 32 == 0)
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // The value tiles alternate between 6 and 7, so each product finds its operand
        // loaded while the one before still runs; every accumulator still adds its
        // block's hi then lo product, block by block.
        for (int32_t b = from / 32; b <= to / 32; ++b) {
          if (block_by_block) PackValues(t, base + b * 32, jlo, jhi, c0 * 16, n, block_.data());
          const uint16_t* v = block_by_block ? block_.data() : &values_[(b * columns + c0) * 512];
          _tile_loadd(4, &p_hi_[r0 * width + b * 32], width * 2);
          _tile_loadd(5, &p_lo_[r0 * width + b * 32], width * 2);
          _tile_loadd(6, v, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, v + 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(0, 5, 6);
          _tile_dpbf16ps(1, 5, 7);
          if (n == 4) {
            _tile_loadd(6, v + 1024, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, v + 1536, 64);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        float* acc = &acc_[r0 * D + c0 * 16];
        _tile_stored(0, acc, D * 4);
        _tile_stored(1, acc + 16, D * 4);
        if (n == 4) {
          _tile_stored(2, acc + 32, D * 4);
          _tile_stored(3, acc + 48, D * 4);
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      Unpermute(&acc_[r * D], D);
      StoreRow(pb, t, r, &acc_[r * D], 1.0f / denom_[r]);
    }
  }

 private:
  // Scores of the 16 rows from r0 against N (1-4) groups of 16 positions from g, summed
  // over head_dim in chunks of 32: each group in its own accumulator (tiles 0 to N - 1),
  // so that consecutive tile products do not wait for each other's sums (one accumulator
  // took ~3x as long: each product waited for the last); per chunk the query's hi and lo
  // (tiles 4, 5) and the groups' keys (6 and 7 in turn). Each accumulator adds the same
  // products in the same order as a group alone: chunk by chunk, hi then lo.
  template <int N>
  void ScoreGroups(int r0, int32_t g, int64_t width) {
    const int64_t D = pb_.head_dim, chunks = D / 32, step = chunks * 512;  // keys_ per group
    _tile_zero(0);
    if constexpr (N > 1) _tile_zero(1);
    if constexpr (N > 2) _tile_zero(2);
    if constexpr (N > 3) _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* k = &keys_[(g * chunks + c) * 512];
      _tile_loadd(4, &q_hi_[r0 * D + c * 32], D * 2);
      _tile_loadd(5, &q_lo_[r0 * D + c * 32], D * 2);
      _tile_loadd(6, k, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (N > 1) {
        _tile_loadd(7, k + step, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_dpbf16ps(0, 5, 6);
      if constexpr (N > 1) _tile_dpbf16ps(1, 5, 7);
      if constexpr (N > 2) {
        _tile_loadd(6, k + 2 * step, 64);
        _tile_dpbf16ps(2, 4, 6);
      }
      if constexpr (N > 3) {
        _tile_loadd(7, k + 3 * step, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      if constexpr (N > 2) _tile_dpbf16ps(2, 5, 6);
      if constexpr (N > 3) _tile_dpbf16ps(3, 5, 7);
    }
    float* out = &scores_[r0 * width + g * 16];
    _tile_stored(0, out, width * 4);
    if constexpr (N > 1) _tile_stored(1, out + 16, width * 4);
    if constexpr (N > 2) _tile_stored(2, out + 32, width * 4);
    if constexpr (N > 3) _tile_stored(3, out + 48, width * 4);
  }

  const uint16_t* Kv() const { return static_cast<const uint16_t*>(pb_.kv); }
  const uint16_t* PageRow(int32_t seq, int64_t plane, int32_t position) const {
    const Problem& pb = pb_;
    const int64_t page = pb.page_table[seq * pb.pages_per_seq + position / pb.page_size];
    return Kv() + CacheRow(pb, plane, page, position % pb.page_size) * pb.head_dim;
  }

  static constexpr int kAhead = 4;  // groups of 16 positions fetched ahead of the one read

  // The rows of positions [first, first + 16) of a K or V plane into the caches: the
  // first level for rows read next (Level 3), the second for rows read after the softmax
  // (Level 1: the first level's few miss buffers stay free for the keys).
  template <int Level = 3>
  JAXSERVE_PREFETCHER void Prefetch(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) const {
    const int64_t row_bytes = pb_.head_dim * 2;
    PageRuns(pb_, seq, plane, std::max(first, jlo), std::min(first + 16, jhi), [&](int64_t row, int32_t, int32_t n) {
      const char* bytes = reinterpret_cast<const char*>(Kv() + row * pb_.head_dim);
      for (int64_t byte = 0; byte < n * row_bytes; byte += 64) __builtin_prefetch(bytes + byte, 0, Level);
    });
  }

  // keys_[group of 16 positions][head_dim / 32][16 pair rows][16 positions][2]: the right
  // operand of q . K^T, row k holding dimensions 2k, 2k + 1 of each position (a 16 x 16
  // transpose of 32-bit pairs).
  // Calls loaded(g) after group g is in.
  template <typename Loaded>
  void LoadKeys(const Tile& t, int32_t base, int32_t blocks, int32_t jlo, int32_t jhi, Loaded&& loaded) {
    const int64_t D = pb_.head_dim, chunks = D / 32;
    keys_.resize(static_cast<size_t>(blocks) * 2 * chunks * 512);
    for (int32_t g = 0; g < std::min(blocks * 2, kAhead); ++g) Prefetch(t.seq, t.kv_head, base + g * 16, jlo, jhi);
    for (int32_t g = 0; g < blocks * 2; ++g) {
      Prefetch(t.seq, t.kv_head, base + (g + kAhead) * 16, jlo, jhi);
      const uint16_t* k[16];
      PlaneRows(pb_, t.seq, t.kv_head, base + g * 16, 16, jlo, jhi, k);
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i x[16];
        for (int n = 0; n < 16; ++n) x[n] = k[n] ? _mm512_loadu_si512(k[n] + c * 32) : _mm512_setzero_si512();
        Transpose16x16(x);
        __m512i* dst = reinterpret_cast<__m512i*>(&keys_[(g * chunks + c) * 512]);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p, x[p]);
      }
      loaded(g);
    }
  }

  // The right operand of p . V for the 32 positions from `first` and `columns` (an even
  // number) of 16 dimensions from dimension d0, into out[column][16 pair rows][16
  // dimensions][2]: row k holds positions 2k, 2k + 1 of each dimension. Per 32 dimensions,
  // an even and an odd position's words are interleaved within 128-bit lanes (vpunpcklwd /
  // vpunpckhwd: a third of the instructions of widening each and merging), which leaves
  // column 2h with dimensions d0 + 32h + {0-3, 8-11, 16-19, 24-27} and column 2h + 1 with
  // the others: the output's columns come out in that order and Unpermute puts them back.
  // A column's products and their order are the same in any order of columns.
  void PackValues(const Tile& t, int32_t first, int32_t jlo, int32_t jhi, int64_t d0, int64_t columns,
                  uint16_t* out) const {
    const uint16_t* v[32];
    PlaneRows(pb_, t.seq, pb_.num_kv_heads + t.kv_head, first, 32, jlo, jhi, v);
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < 16; ++k) {
      const uint16_t *even = v[2 * k], *odd = v[2 * k + 1];
      for (int64_t h = 0; h < columns / 2; ++h) {
        const __m512i e = even ? _mm512_loadu_si512(even + d0 + h * 32) : zero;
        const __m512i o = odd ? _mm512_loadu_si512(odd + d0 + h * 32) : zero;
        uint16_t* dst = out + (2 * h * 16 + k) * 32;
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(e, o));
        _mm512_storeu_si512(dst + 512, _mm512_unpackhi_epi16(e, o));
      }
    }
  }

  // values_[block of 32 positions][head_dim / 16][16 pair rows][16 dimensions][2]: every
  // block's PackValues.
  void LoadValues(const Tile& t, int32_t base, int32_t blocks, int32_t jlo, int32_t jhi) {
    const int64_t columns = pb_.head_dim / 16;
    values_.resize(static_cast<size_t>(blocks) * columns * 512);
    for (int32_t b = 0; b < blocks; ++b) PackValues(t, base + b * 32, jlo, jhi, 0, columns, &values_[b * columns * 512]);
  }

  // A row of the p . V product (D floats, its columns in PackValues' order) put in order.
  static void Unpermute(float* acc, int64_t D) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 a = _mm512_loadu_ps(acc + d), b = _mm512_loadu_ps(acc + d + 16);
      _mm512_storeu_ps(acc + d, _mm512_permutex2var_ps(a, lo, b));
      _mm512_storeu_ps(acc + d + 16, _mm512_permutex2var_ps(a, hi, b));
    }
  }

  const Problem& pb_;
  std::vector<int32_t> pos_, lo_;
  std::vector<uint16_t> q_hi_, q_lo_, p_hi_, p_lo_, keys_, values_;
  std::vector<uint16_t> q_t_ = std::vector<uint16_t>(4 * 512);  // q^T as hi, lo per 32 of head_dim
  std::vector<uint16_t> block_ = std::vector<uint16_t>(4 * 512);  // PackValues of 4 columns
  std::vector<float> scores_, denom_, acc_;
};
#endif  // JAXSERVE_HAVE_AMX

bool AttentionUsesAmx() {
#ifdef JAXSERVE_HAVE_AMX
  return jaxserve::AmxUsable();
#else
  return false;
#endif
}

// One call's tiles, shared by the threads that work on them.
struct Work {
  Problem pb;
  std::vector<Tile> tiles;
  ffi::DataType kind = ffi::DataType::F32;  // the cache's element type
  bool amx = false;  // AmxTileRunner's tiles (a bfloat16 cache, head_dim % 32 == 0, AMX usable)
  std::atomic<size_t> next{0};  // the next tile to take
};

// Runs tiles until none is left. Which thread runs a tile never changes its result.
template <typename T, int C>
void DrainOf(Work& work) {
  TileRunner<T, C> runner(work.pb);
  for (size_t i; (i = work.next.fetch_add(1)) < work.tiles.size();) runner.Run(work.tiles[i]);
}

template <typename T>
void DrainAs(Work& work) {
  switch (work.pb.head_dim) {
    case 16: return DrainOf<T, 1>(work);
    case 32: return DrainOf<T, 2>(work);
    case 64: return DrainOf<T, 4>(work);
    case 128: return DrainOf<T, 8>(work);
    default: return DrainOf<T, 0>(work);
  }
}

void Drain(Work& work) {
#ifdef JAXSERVE_HAVE_AMX
  if (work.amx) {
    jaxserve::TileScope tiles;
    AmxTileRunner runner(work.pb);
    for (size_t i; (i = work.next.fetch_add(1)) < work.tiles.size();) runner.Run(work.tiles[i]);
    return;
  }
#endif
  switch (work.kind) {
    case ffi::DataType::U16: return DrainAs<uint16_t>(work);
    case ffi::DataType::S8: return DrainAs<int8_t>(work);
    case ffi::DataType::F8E4M3FN: return DrainAs<Fp8>(work);
    default: return DrainAs<float>(work);
  }
}

// This step's keys and values from the product (columns Hq * D on: k's heads, then v's)
// into their slots of a float32 or bfloat16 cache, k rotated as the queries are
// (ProductRow), each value rounded as XLA's cast would (Bf16Bits): what
// reference.ref_write_kv's scatter stores of QkvProduct.keys_values(). Only the
// sequences' tokens are written (the scatter also wrote padding tokens into page 0, which
// nothing reads). Throws nothing: the slots were checked.
void WriteKv(ffi::ThreadPool& pool, const Problem& pb, void* cache, bool bf16, const int32_t* slots, int32_t lo,
             int32_t hi) {
  const int64_t D = pb.head_dim, hkv = pb.num_kv_heads, k_col = pb.num_heads * D;
  constexpr int32_t kTokens = 16;  // per work item
  jaxserve::RunOnPool(pool, (hi - lo + kTokens - 1) / kTokens, [&](int item) {
    thread_local std::vector<float> buf;
    buf.resize(2 * D);
    for (int32_t t = lo + item * kTokens; t < std::min(hi, lo + (item + 1) * kTokens); ++t) {
      const int64_t page = slots[t] / pb.page_size, slot = slots[t] % pb.page_size;
      for (int64_t plane = 0; plane < 2 * hkv; ++plane) {  // k's heads, then v's
        const float* row = ProductRow(pb, t, k_col + plane * D, plane < hkv, buf.data());
        const int64_t at = CacheRow(pb, plane, page, slot) * D;
        if (bf16) {
          uint16_t* dst = static_cast<uint16_t*>(cache) + at;
          for (int64_t d = 0; d < D; ++d) dst[d] = jaxserve::Bf16Bits(row[d]);
        } else {
          std::memcpy(static_cast<float*>(cache) + at, row, D * sizeof(float));
        }
      }
    }
  });
}

// Attention of a step (the Problem's contract above) into `out` ([T, Hq, D]), and with
// `slots` ([T]) first the step's keys and values into kv_data (WriteKv); without `out`,
// the write alone (Hq is then `num_heads`). kv_cache describes the cache's shape.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& cos, ffi::Buffer<ffi::F32>& sin,
               ffi::AnyBuffer& kv_cache, void* kv_data, ffi::Buffer<ffi::F32>& scales, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::S32>& kv_lens, ffi::Buffer<ffi::S32>& page_table,
               ffi::Buffer<ffi::S32>& query_start_loc, ffi::Buffer<ffi::S32>& window, float sm_scale,
               ffi::Result<ffi::AnyBuffer>* out, const ffi::Buffer<ffi::S32>* slots, int64_t num_heads = 0) {
  auto qd = q.dimensions();
  auto kd = kv_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || page_table.dimensions().size() != 2 ||
      (out != nullptr && (*out)->dimensions().size() != 3)) {
    return ffi::Error::InvalidArgument(
        "q must be [slices, T, N / slices], out [T, Hq, D], kv_cache 5-D and page_table 2-D");
  }
  // [T, Hq, D]: the output's, or for a write alone q's T, num_heads and the cache's D.
  std::array<int64_t, 3> od{qd[1], num_heads, kd[4]};
  if (out != nullptr) std::copy_n((*out)->dimensions().begin(), 3, od.begin());
  if (qd[1] != od[0] || od[1] <= 0 || qd[0] * qd[2] < od[1] * od[2]) {
    return ffi::Error::InvalidArgument("q's slices must hold [T, Hq * D] of out's T, Hq and D");
  }
  const bool rotate = cos.element_count() > 0;
  auto cd = cos.dimensions(), sd = sin.dimensions();
  if (rotate && (cd.size() != 2 || cd[0] != od[0] || cd[1] != od[2] || od[2] % 2 ||
                 !std::equal(cd.begin(), cd.end(), sd.begin(), sd.end()))) {
    return ffi::Error::InvalidArgument("cos and sin must be [T, D] (an even D), or empty: q rotated already");
  }
  const ffi::DataType kind = kv_cache.element_type();
  if (kind != ffi::DataType::F32 && kind != ffi::DataType::U16 && kind != ffi::DataType::S8 &&
      kind != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("kv_cache must be float32, uint16 (bfloat16 bits), int8 or float8_e4m3fn");
  }
  const bool scaled = kind == ffi::DataType::S8 || kind == ffi::DataType::F8E4M3FN;
  auto scd = scales.dimensions();
  if (scaled && (scd.size() != 4 || !std::equal(scd.begin(), scd.end(), kd.begin()))) {
    return ffi::Error::InvalidArgument("an 8-bit kv_cache needs scales [2*Hkv, L, num_pages, page_size]");
  }
  auto work = std::make_unique<Work>();
  work->kind = kind;
  Problem& pb = work->pb;
  pb.q = q.typed_data();
  pb.q_slices = qd[0];
  pb.q_width = qd[2];
  pb.cos = rotate ? cos.typed_data() : nullptr;
  pb.sin = rotate ? sin.typed_data() : nullptr;
  pb.kv = kv_data;
  pb.scales = scaled ? scales.typed_data() : nullptr;
  pb.num_tokens = od[0];
  pb.num_heads = od[1];
  pb.head_dim = od[2];
  pb.num_kv_heads = kd[0] / 2;
  pb.num_layers = kd[1];
  pb.num_pages = kd[2];
  pb.page_size = kd[3];
  if (kd[4] != pb.head_dim || pb.num_heads % pb.num_kv_heads) {
    return ffi::Error::InvalidArgument("q's heads / head_dim do not match kv_cache");
  }
  pb.layer = layer.typed_data()[0];
  if (pb.layer < 0 || pb.layer >= pb.num_layers) {
    return ffi::Error::InvalidArgument("layer " + std::to_string(pb.layer) + " is not a layer of the cache");
  }
  pb.window = window.typed_data()[0];
  pb.kv_lens = kv_lens.typed_data();
  pb.page_table = page_table.typed_data();
  pb.pages_per_seq = page_table.dimensions()[1];
  pb.query_start_loc = query_start_loc.typed_data();
  pb.sm_scale = sm_scale;
  pb.out = out != nullptr ? (*out)->untyped_data() : nullptr;
  pb.out_bf16 = out != nullptr && (*out)->element_type() == ffi::DataType::BF16;
  if (out != nullptr && !pb.out_bf16 && (*out)->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("out must be float32 or bfloat16");
  }
  work->amx = kind == ffi::DataType::U16 && pb.head_dim % 32 == 0 && AttentionUsesAmx();
  const int64_t num_seqs = kv_lens.dimensions()[0];

  // Bad metadata must not read outside the buffers: check every sequence's bounds and the
  // pages it will read (a few hundred integers; the reference would clamp silently).
  if (pb.query_start_loc[0] < 0 || pb.query_start_loc[num_seqs] > pb.num_tokens) {
    return ffi::Error::InvalidArgument("query_start_loc must lie within [0, num_tokens]");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = pb.query_start_loc[s + 1] - pb.query_start_loc[s];
    const int32_t kv_len = pb.kv_lens[s];
    if (q_len < 0 || (q_len > 0 && (kv_len < q_len || kv_len > pb.pages_per_seq * pb.page_size))) {
      return ffi::Error::InvalidArgument(
          "sequence " + std::to_string(s) + ": need 0 <= q_len <= kv_len <= pages_per_seq * page_size, got q_len " +
          std::to_string(q_len) + ", kv_len " + std::to_string(kv_len));
    }
    for (int64_t i = 0; q_len > 0 && i < (kv_len + pb.page_size - 1) / pb.page_size; ++i) {
      const int32_t page = pb.page_table[s * pb.pages_per_seq + i];
      if (page < 0 || page >= pb.num_pages) {
        return ffi::Error::InvalidArgument("page_table[" + std::to_string(s) + ", " + std::to_string(i) + "] = " +
                                           std::to_string(page) + " is not a page of the cache");
      }
    }
  }

  if (slots != nullptr) {
    const int32_t lo = pb.query_start_loc[0], hi = pb.query_start_loc[num_seqs];
    if (kind != ffi::DataType::F32 && kind != ffi::DataType::U16) {
      return ffi::Error::InvalidArgument("the kernel writes a float32 or bfloat16 cache only");
    }
    if (slots->element_count() != pb.num_tokens) return ffi::Error::InvalidArgument("slot_mapping must be [T]");
    if (pb.q_slices * pb.q_width < (pb.num_heads + 2 * pb.num_kv_heads) * pb.head_dim) {
      return ffi::Error::InvalidArgument("the product must hold [T, (Hq + 2 Hkv) * D]: q, k and v");
    }
    const int32_t* slot = slots->typed_data();
    for (int32_t t = lo; t < hi; ++t) {
      if (slot[t] < 0 || slot[t] >= pb.num_pages * pb.page_size) {
        return ffi::Error::InvalidArgument("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot[t]) +
                                           " is not a slot of the cache");
      }
    }
    WriteKv(pool, pb, kv_data, kind == ffi::DataType::U16, slot, lo, hi);
  }
  if (out == nullptr) return ffi::Error::Success();

  // Every row of a sequence's tokens is stored by its tile; the tokens outside all
  // sequences (padding) come out zero. Zeroing the whole output first was a pass over it
  // per layer (~1 MB at 512 tokens of SmolLM2, ~0.1 ms on a 2-core Xeon).
  const size_t row_bytes = static_cast<size_t>(pb.num_heads * pb.head_dim) * (pb.out_bf16 ? 2 : 4);
  char* out_bytes = static_cast<char*>(pb.out);
  std::memset(out_bytes, 0, pb.query_start_loc[0] * row_bytes);
  std::memset(out_bytes + pb.query_start_loc[num_seqs] * row_bytes, 0,
              (pb.num_tokens - pb.query_start_loc[num_seqs]) * row_bytes);
  const int32_t group = static_cast<int32_t>(pb.num_heads / pb.num_kv_heads);
  const int32_t tokens_per_tile = std::max<int32_t>(1, kRows / group);
  std::vector<Tile>& tiles = work->tiles;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = pb.query_start_loc[s + 1] - pb.query_start_loc[s];
    if (q_len <= 0) continue;
    for (int32_t h = 0; h < pb.num_kv_heads; ++h) {
      for (int32_t i = 0; i < q_len; i += tokens_per_tile) {
        tiles.push_back({s, h, i, std::min(tokens_per_tile, q_len - i)});
      }
    }
  }
  // This thread and XLA's other intra-op threads take tiles until none is left.
  const int workers = static_cast<int>(std::min<size_t>(pool.num_threads() + 1, tiles.size()));
  jaxserve::RunOnPool(pool, workers, [&](int) { Drain(*work); });
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                  ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                  ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window, float sm_scale,
                  ffi::Result<ffi::AnyBuffer> out) {
  return Run(pool, q, cos, sin, kv_cache, kv_cache.untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, sm_scale, &out, nullptr);
}

// Attend, after writing the step's K/V into the cache in place: `cache` is kv_cache's
// buffer (the call aliases them), so the scatter XLA ran before, and its pass that rotated
// k and cast it for the cache, are gone (~2.5 ms of a 500-token SmolLM2 prefill, 2-core
// AMX Xeon).
ffi::Error WriteAndAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                          ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> slot_mapping, float sm_scale,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> cache) {
  if (cache->untyped_data() != kv_cache.untyped_data()) {
    return ffi::Error::InvalidArgument("the written cache must alias kv_cache (input_output_aliases)");
  }
  return Run(pool, q, cos, sin, kv_cache, cache->untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, sm_scale, &out, &slot_mapping);
}

// WriteAndAttend's write alone, for a step whose attention runs for some rows only (a
// model's last layer: the rows whose logits the step needs), so that every token's K and
// V in the cache are the same bits whichever call wrote them.
ffi::Error Write(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                 ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer,
                 ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                 ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window,
                 ffi::Buffer<ffi::S32> slot_mapping, int64_t num_heads, ffi::Result<ffi::AnyBuffer> cache) {
  if (cache->untyped_data() != kv_cache.untyped_data()) {
    return ffi::Error::InvalidArgument("the written cache must alias kv_cache (input_output_aliases)");
  }
  return Run(pool, q, cos, sin, kv_cache, cache->untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, 1.0f, nullptr, &slot_mapping, num_heads);
}

}  // namespace

// Whether a bfloat16 cache is read with AMX tiles (a head_dim that is a multiple of 32).
extern "C" int JaxserveAttentionAmx() { return AttentionUsesAmx() ? 1 : 0; }

// For the tests: how many of the float32 values in [lo, 0] whose bit pattern is a multiple
// of `stride` from lo's get another exp from the softmax's intrinsics (ExpNonPositive512,
// ExpNonPositive256) than from ExpNonPositiveGeneric, bit for bit; -1 without AVX-512 or
// AVX2 + FMA (one code).
extern "C" int64_t JaxserveExpMismatches(float lo, uint32_t stride) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  uint32_t bits, end;
  const float zero = -0.0f;
  std::memcpy(&bits, &lo, sizeof bits);
  std::memcpy(&end, &zero, sizeof end);  // negative floats: bits fall as values rise to -0
  int64_t mismatches = 0;
  Lanes x;
  for (int64_t b = bits; b >= end;) {
    for (int i = 0; i < kLanes; ++i, b -= std::max<uint32_t>(stride, 1)) {
      const uint32_t u = static_cast<uint32_t>(std::max<int64_t>(b, end));
      std::memcpy(&x[i], &u, sizeof u);
    }
    const Lanes generic = jaxserve::ExpNonPositiveGeneric<Lanes, Ints>(x);
#ifdef __AVX512F__
    const Lanes fast = ExpNonPositive(x);
#else
    Lanes fast;
    for (int h = 0; h < 2; ++h) {
      const __m256 e = jaxserve::ExpNonPositive256(_mm256_loadu_ps(reinterpret_cast<const float*>(&x) + 8 * h));
      _mm256_storeu_ps(reinterpret_cast<float*>(&fast) + 8 * h, e);
    }
#endif
    for (int i = 0; i < kLanes; ++i) mismatches += std::memcmp(&fast[i], &generic[i], sizeof(float)) != 0;
  }
  return mismatches;
#else
  (void)lo;
  (void)stride;
  return -1;
#endif
}

// The threads every CPU kernel of the library splits its work over (cpu_threads.h).
extern "C" int JaxserveThreads() { return jaxserve::Threads(); }

// The operands of the calls that write the product's k and v (WriteAndAttend, Write).
static auto ProductWriteOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
      .Arg<ffi::Buffer<ffi::F32>>()   // the qkv product [slices, T, N / slices]
      .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D], or empty
      .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D], or empty
      .Arg<ffi::AnyBuffer>()          // kv_cache (float32 or bfloat16 bits)
      .Arg<ffi::Buffer<ffi::F32>>()   // scales (unused)
      .Arg<ffi::Buffer<ffi::S32>>()   // layer
      .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
      .Arg<ffi::Buffer<ffi::S32>>()   // page_table
      .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
      .Arg<ffi::Buffer<ffi::S32>>()   // sliding window
      .Arg<ffi::Buffer<ffi::S32>>();  // slot_mapping [T]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteAndAttend, WriteAndAttend,
                              ProductWriteOperands()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()    // [T, Hq, D] float32 or bfloat16
                                  .Ret<ffi::AnyBuffer>());  // the cache, written (aliases kv_cache)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, Write,
                              ProductWriteOperands()
                                  .Attr<int64_t>("num_heads")  // Hq: the product's q heads
                                  .Ret<ffi::AnyBuffer>());     // the cache, written (aliases kv_cache)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [slices, T, N / slices]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D], or empty
                                  .Arg<ffi::AnyBuffer>()          // kv_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales (8-bit caches; else any)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());        // [T, Hq, D] float32 or bfloat16
